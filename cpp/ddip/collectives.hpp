// The picture of a hang, by collective: per rank, the last completed and the pending collective
// (sequence number, op, process group, shapes and dtypes, for how long), read from each rank's
// torch flight recorder (python/ddip/rank/collectives.py's snapshot()); then who has not joined
// the collective the others wait in, or who disagrees with them about it. One rule for the kernel
// (%dipstack, Group.stacks(), a cell that timed out, heal) and for `ddip run` (--timeout, Ctrl-C).
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace ddip {

// A live process group as a rank sees it: its ranks, and how many collectives it has issued
// (unknown for a backend that does not count them).
struct GroupInfo {
  std::vector<int> ranks;
  std::optional<std::int64_t> issued;
};

// A snapshot's live process groups (python/ddip/rank/collectives.py's snapshot()), from
// {"groups": {"name": {"ranks": [...], "issued": N}}} (or {"name": [ranks]}): the one reading
// CollectivePicture and Stragglers share. A group whose ranks are not a list of numbers is left
// out (its members are then the ranks that ran its collectives).
std::map<std::string, GroupInfo> read_groups(const nlohmann::json& snapshot);

// A flight-recorder record, as far as telling whose it is goes: its process group, the group's id
// in the recorder (one per group made: a rebuild's anew), its sequence number there, and p2p.
struct RecordId {
  std::string pg;
  std::int64_t gen = 0;
  std::int64_t seq = 0;
  bool p2p = false;
};

// Which of one rank's records (oldest first) are of its live groups' current generations: the
// one rule CollectivePicture and Stragglers (stragglers.hpp) read records by. The recorder
// outlives a group: one destroyed and made again under the same name (a heal, a framework's own
// set-up) numbers from #1 again under a new id, and its older records are history, not a
// collective in flight. A live group's newest id is its current one, unless it has issued fewer
// collectives than those records number (none yet: every record is an older group's). A group
// the rank no longer has (destroyed) is history too. `groups`: the rank's live groups
// (read_groups), with how many collectives each has issued; where the rank listed no groups, each
// group's newest generation is kept.
std::vector<bool> current_records(const std::vector<RecordId>& records,
                                  const std::map<std::string, GroupInfo>& groups);

class CollectivePicture {
 public:
  // rank -> that rank's snapshot, the JSON text of python/ddip/rank/collectives.py's snapshot():
  // {"rank","world","now_ns","groups":{name:{"ranks","issued"}},"entries":[{seq,gen,p2p,pg,op,
  // sizes,dtypes,done,created_ns}]}; {"outside": "left" | "uninitialized"} from a rank in no
  // group, which is missing from any collective of a group whose other ranks list it; or
  // {"off": why, "last_words": [a dead rank's last lines of stderr]} where nothing can be read.
  // Only the records of each live group's current generation count: those of a group destroyed
  // or made anew under the same name (a heal) are history. A text that does not parse counts as
  // that rank's "off" (with the parser's reason).
  explicit CollectivePicture(const std::map<int, std::string>& snapshots);

  // Whether any rank had collectives to show.
  bool known() const { return known_; }
  // The block messages lead with: a title, rank_lines() indented, then "=> " + each finding;
  // "" when !known().
  std::string describe() const;
  // One line per rank, in rank order: where it is among its collectives, or why it has none.
  std::vector<std::string> rank_lines() const { return rank_lines_; }
  // Who has not entered the collective the others wait in, who disagrees about it; a dead rank
  // with its last words, after the survivors' last collective.
  const std::vector<std::string>& findings() const { return findings_; }

  // What the kernel's heal reads: ranks missing from the collective others wait in, ranks waiting
  // in one, and the ranks of a disagreement (those that differ and those they differ from).
  std::set<int> missing() const;
  std::set<int> waiting() const;
  std::set<int> mismatched() const { return mismatched_; }
  // rank -> the collective the others wait in that it has not entered ("all_reduce #7
  // (float32[1024])", " of group 'name'" after it outside the default group).
  const std::map<int, std::string>& missing_from() const { return missing_from_; }
  // rank -> the collective it waits in, written the same way.
  const std::map<int, std::string>& waiting_in() const { return waiting_in_; }
  // rank -> how long it has waited in that collective, in seconds.
  const std::map<int, double>& waited_s() const { return waited_s_; }

 private:
  bool known_ = false;
  std::vector<std::string> rank_lines_;
  std::vector<std::string> findings_;
  std::set<int> mismatched_;
  std::map<int, std::string> missing_from_;
  std::map<int, std::string> waiting_in_;
  std::map<int, double> waited_s_;
};

}  // namespace ddip
