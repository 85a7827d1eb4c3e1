// torchrun's elastic contract in `ddip run`'s ranks: the TORCHELASTIC_* variables its agent sets
// (torch/distributed/elastic/agent/server/local_elastic_agent.py, launcher/api.py), and the error
// files a rank writes when it dies inside a function decorated with torch's
// torch.distributed.elastic.multiprocessing.errors.record (multiprocessing/errors/).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ddip::run {

// The signals ddip run forwards to its ranks (TORCHELASTIC_SIGNALS_TO_HANDLE, in torchrun's
// order): torchrun also handles SIGQUIT, ddip run leaves it alone.
inline constexpr std::string_view kSignalsToHandle = "SIGTERM,SIGINT,SIGHUP";

// A random job id in UUID 4 form, as torchrun --standalone makes one: TORCHELASTIC_RUN_ID for
// every rank of one launch, on every host.
std::string new_run_id();

// torchrun's TORCHELASTIC_* variables, added to a rank's environment (rank_environment's, which
// holds none): the run id, the attempt's restart count and --max-restarts,
// TORCHELASTIC_USE_AGENT_STORE=False (no agent serves a TCPStore: rank 0 hosts it, as without
// torchrun), the signals ddip run forwards, and the rank's error file when there is one.
void add_elastic_environment(std::vector<std::string>& env, const std::string& run_id,
                             const std::string& error_file, int restart_count = 0,
                             int max_restarts = 0);

// One launch's error files on this host, one per rank, in a private directory (0700) made under
// $TMPDIR (else /tmp) and removed with everything in it when this goes.
class ErrorFiles {
 public:
  // Throws std::system_error naming the directory it could not make.
  ErrorFiles();
  ErrorFiles(const ErrorFiles&) = delete;
  ErrorFiles& operator=(const ErrorFiles&) = delete;
  ~ErrorFiles();

  // Rank `rank`'s TORCHELASTIC_ERROR_FILE (not made: the rank writes it if it fails so).
  std::string path(int rank) const;
  // Its content, when the rank wrote one ("" when not, or when it is larger than 1 MiB).
  std::string read(int rank) const { return read_file(path(rank)); }
  // The same for an error file elsewhere (--log-dir's <local rank>/error.json).
  static std::string read_file(const std::string& path);
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
};

// What an error file says, as torchrun's report shows it: the message ("ValueError: bad
// batch"), and the traceback (py_callstack) line by line. nullopt for text that is not JSON with
// a "message" (torch's ErrorHandler writes {"message": {"message": ..., "extraInfo":
// {"py_callstack": ..., "timestamp": ...}}}; a string "message" is its newer form).
struct RankError {
  std::string message;
  std::vector<std::string> traceback;
};
std::optional<RankError> read_rank_error(std::string_view json);

// What torchrun does with its own TORCHELASTIC_ERROR_FILE when a rank's failure is the root
// cause and that rank wrote an error file (ErrorHandler.dump_error_file): the rank's JSON, with
// message.errorCode set to how it ended (its exit code, or minus the signal that killed it, as
// torch counts them) unless that is 0 or the message is a plain string. Throws
// std::invalid_argument when `json` is not a JSON object.
std::string parent_error_json(std::string_view json, int error_code);

}  // namespace ddip::run
