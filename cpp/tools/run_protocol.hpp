// What two `ddip run`s say to each other: the one started on another host (`ddip run --node`)
// and the one that started it through a launcher (ssh, srun, a launcher command). Every message is
// one line, "\x1e" "ddip KIND FIELD...\n", encoded and decoded only here.
//
// - To the host (its stdin, the control channel): Ping, Signal, Stop, Kill, Answer, Collect.
// - From the host (its stderr, between its ranks' labelled lines): RankFailed, NodeDone, Prompt,
//   RankState, and Signalled from a node that joined the job itself (run_join.hpp). A rank writes
//   Prompt itself (ddip.rank.run_debug, on its stderr) when its breakpoint() waits for a line, and
//   RankState (ddip.rank.run_hook) when asked by SIGURG; its host's ddip run hands them on.
//
// A record begins with an ASCII record separator, which no line of a rank can begin with (its
// host labels every one "[rank] "). Fields are separated by one space; text fields escape
// '\\' "\\\\", ' ' "\\s", '\n' "\\n", '\r' "\\r", and the empty text is "\\e", so a record is
// always one line with a field count that can be checked, whatever a rank printed.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace ddip::run::protocol {

inline constexpr std::string_view kPrefix = "\x1e" "ddip ";

// A line the decoder can't read: a truncated or garbled record, or one from another version of
// ddip. what() says which field is wrong and quotes the line.
struct ProtocolError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// -- to a host's ddip run ---------------------------------------------------------------------

// "Still here": sent every few seconds, so a host that hears nothing knows its link is gone.
struct Ping {
  bool operator==(const Ping&) const = default;
};
// Forward `number` (SIGINT, SIGTERM, ...) to every rank there.
struct Signal {
  int number = 0;
  bool operator==(const Signal&) const = default;
};
// Stop every rank there: SIGTERM, the grace period, SIGKILL.
struct Stop {
  bool operator==(const Stop&) const = default;
};
// SIGKILL every rank there now.
struct Kill {
  bool operator==(const Kill&) const = default;
};
// The line typed at rank `rank`'s debugger prompt (without its line end), for its stdin; `end`:
// nobody can answer (ddip run's stdin has ended), so its stdin closes.
struct Answer {
  int rank = 0;
  bool end = false;
  std::string line;
  bool operator==(const Answer&) const = default;
};
// Ask every rank there for its collectives and stack (SIGURG, run_collectives.hpp): each answers
// with a RankState, handed on; a rank that can't answer gets one without a snapshot at once.
struct Collect {
  bool operator==(const Collect&) const = default;
};
using Control = std::variant<Ping, Signal, Stop, Kill, Answer, Collect>;

// -- from a host's ddip run -------------------------------------------------------------------

// The first of its ranks to fail, sent as soon as it is seen.
struct RankFailed {
  int rank = 0;        // global RANK
  int exit_code = 0;   // when it exited
  int signal = 0;      // the signal that killed it, or 0
  int64_t when_ns = 0; // CLOCK_REALTIME on its host when the failure was seen
  std::string what;    // "exit code 3", "killed by SIGSEGV"
  std::string error;   // its TORCHELASTIC_ERROR_FILE's JSON, or "" (run_elastic.hpp)
  std::vector<std::string> tail;  // the last lines of its stderr, without line ends
  bool operator==(const RankFailed&) const = default;
};
// How one rank ended ("exit code 0", "killed by SIGTERM (stopped by ddip run)").
struct RankEnd {
  int rank = 0;
  std::string what;
  bool operator==(const RankEnd&) const = default;
};
// The host's ddip run is ending: every one of its ranks' ends, in rank order.
struct NodeDone {
  std::vector<RankEnd> ranks;
  bool operator==(const NodeDone&) const = default;
};
// Rank `rank` waits at a debugger prompt (breakpoint()): what its debugger printed since its
// last prompt, and the prompt ("ipdb> "). Its answer goes back as Answer. An empty prompt says
// the debugger has left (continue, or no answer): `output` is its last words, and another rank
// may have its turn.
struct Prompt {
  int rank = 0;
  std::string output;
  std::string prompt;
  bool operator==(const Prompt&) const = default;
};
// Rank `rank`'s answer to SIGURG (ddip.rank.run_hook): its torch flight recorder's snapshot
// (the JSON of python/ddip/rank/collectives.py's snapshot()) and its main thread's Python stack.
// An empty snapshot, from a host's ddip run: that rank can't answer (it has ended, or it is not a
// Python rank with ddip's hook), so nobody waits for it.
struct RankState {
  int rank = 0;
  std::string snapshot;
  std::string stack;
  bool operator==(const RankState&) const = default;
};
// A node that joined the job itself (run_join.hpp) got `number` (Ctrl-C at its terminal, a
// scheduler's SIGTERM): the job's host acts on it as on its own, for every node.
struct Signalled {
  int number = 0;
  bool operator==(const Signalled&) const = default;
};
using Report = std::variant<RankFailed, NodeDone, Prompt, RankState, Signalled>;

// -- forming a job from one ddip run per node (run_join.hpp) ----------------------------------
//
// On a TCP connection from a node to the job's host: Welcome; with a shared key, Hello and
// Accept (the key's challenge-response, ddip/auth.hpp), after which every line is sealed
// (SealedLines, run_channel.hpp); then Join, answered by Refuse or, once the job forms, Start.
// Each attempt then runs the control channel above on the same connection, and ends with End.

// The job's host, first: whether it wants the shared key, and its challenge (hex) if so.
struct Welcome {
  bool keyed = false;
  std::string challenge;
  bool operator==(const Welcome&) const = default;
};
// The node's answer to the challenge (hex), and the host's proof that it knows the key too.
struct Hello {
  std::string response;
  bool operator==(const Hello&) const = default;
};
struct Accept {
  std::string proof;
  bool operator==(const Accept&) const = default;
};
// A node asks to join: the job it means, its place (-1: given on arrival), its ranks, its
// --timeout (0: none) and its host's name.
struct Join {
  std::string run_id;
  int node_rank = -1;
  int nproc = 1;
  double timeout_s = 0;
  std::string name;
  bool operator==(const Join&) const = default;
};
// The host will not have it, and why (a run id of another job, a node rank taken).
struct Refuse {
  std::string why;
  bool operator==(const Refuse&) const = default;
};
// An attempt starts: the node's place in it, where rank 0 serves torch's store, and the
// restart count.
struct Start {
  int restart = 0, max_restarts = 0;
  int rank_offset = 0, world_size = 1, node_rank = 0, nnodes = 1;
  std::string master_addr;
  int master_port = 0;
  std::string run_id;
  bool prompts = false;  // the host can answer the ranks' debugger prompts
  bool operator==(const Start&) const = default;
};
// An attempt has ended on every node: the job's outcome as the host's report gives it, so every
// node names the root cause; `restart`: another attempt follows (a Start).
struct End {
  bool restart = false;
  int exit_code = 0;
  bool failed = false;  // a root cause follows
  int rank = -1;        // its rank, -1 for a node's ddip run
  std::string who, what;
  std::string error;
  std::vector<std::string> tail;
  bool timed_out = false;
  double timeout_s = 0;
  int first_signal = 0;
  bool grace_ran_out = false;
  bool operator==(const End&) const = default;
};
using JoinRecord = std::variant<Welcome, Hello, Accept, Join, Refuse, Start, End>;
std::string encode(const JoinRecord& record);
// Throws ProtocolError for anything else.
JoinRecord decode_join(std::string_view line);

// -- files shipped to a host's ddip run (--ship) -------------------------------------------------

// Before any control record, the channel carries the files to ship: for each, this header as
// one record, then exactly `size` bytes of content. A file travels with the launch this way
// (not on a command line), whatever its size; the host's ddip run writes it into a private
// directory of its own.
struct FileHeader {
  std::string path;   // as given to --ship here: the command's arguments equal to it name the copy
  uint64_t size = 0;  // bytes of content that follow the header
  uint32_t mode = 0600;  // its permission bits here (rwx of its owner)
  bool operator==(const FileHeader&) const = default;
};
// The largest file that may be shipped: a bound a garbled header can't exceed.
inline constexpr uint64_t kMaxShipBytes = uint64_t(1) << 32;
std::string encode(const FileHeader& header);
FileHeader decode_file_header(std::string_view line);

// One record: kPrefix, the fields, '\n'.
std::string encode(const Control& message);
std::string encode(const Report& message);

// Whether `line` is a record (starts with kPrefix) rather than text to show.
inline bool is_record(std::string_view line) { return line.substr(0, kPrefix.size()) == kPrefix; }

// One record, with or without its line end ("\n", "\r\n"). Throws ProtocolError for anything
// that is not exactly a record of the expected direction.
Control decode_control(std::string_view line);
Report decode_report(std::string_view line);

// The longest line typed at a prompt that is sent on (a terminal's own limit is 4096).
inline constexpr size_t kMaxAnswer = 16384;
// The longest control record a host's ddip run reads (a line without '\n' by then is garbage):
// an Answer of kMaxAnswer bytes, every one escaped.
inline constexpr size_t kMaxControlLine = 2 * kMaxAnswer + 64;

// The control channel's bytes, as they arrive, into messages.
class ControlReader {
 public:
  void feed(std::string_view data) { pending_.append(data); }
  // The next whole message, or nullopt until more arrives. Throws ProtocolError for a malformed
  // record, or for a line still without its end after kMaxControlLine bytes.
  std::optional<Control> next();

 private:
  std::string pending_;
};

}  // namespace ddip::run::protocol
