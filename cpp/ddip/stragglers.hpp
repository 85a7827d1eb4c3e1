// The straggler named: who the others waited for in the last K collectives, read from the time
// each rank entered each collective in its torch flight recorder (the "entered" records of
// python/ddip/rank/collectives.py's snapshot(), the snapshot CollectivePicture reads). Per
// collective the rank that entered last made every other member wait from its own entry to the
// last one; that wait is the last rank's doing. One rule for Group.stragglers() and %dipstack.
//
// Times are the recorder's time_created_ns: the wall clock (system_clock) when the rank's code
// called the collective, the only time gloo records (time_discovered_started/completed_ns stay 0
// there). Ranks on one host share that clock. Across hosts the rule takes the hosts' clocks as
// agreeing (NTP keeps them within a few milliseconds); what they disagree by reads as wait, which
// the thresholds below are meant to absorb.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace ddip {

// One collective of the window, in the order their last ranks entered them.
struct WaitedCollective {
  std::string pg;  // its process group's name ("0" is the default group)
  std::int64_t seq = 0;
  std::string op;
  double at_s = 0;  // when its last rank entered it, in seconds from the window's start
  int last = -1;    // the rank that entered it last
  // How long the other members waited there for `last`, summed over them (a stretch of a rank's
  // time that an earlier collective of the window counted already, counts once).
  double wait_s = 0;
};

class Stragglers {
 public:
  // A straggler holds the others up for at least this share of their time in the window: below
  // it, the differences are scheduling jitter (and, across hosts, clocks a few ms apart), not one
  // rank's doing.
  static constexpr double kMinShare = 0.10;
  // ... and for at least this many times as long as any other rank: where several ranks take
  // turns being last (a load spread over them), none of them is the straggler.
  static constexpr double kLead = 2.0;
  // ... over at least this many collectives: a straggler holds the others up again and again;
  // in fewer, one slow start (a rank's imports before the first collective) would be named.
  static constexpr int kMinWindow = 3;

  // rank -> that rank's snapshot as JSON text (CollectivePicture's input); `last`: how many of
  // the most recent collectives to look at (>= 1, else std::invalid_argument). A collective
  // counts once every member of its group that could be read has a record of it (the ring
  // buffer may have dropped the oldest ones, and one in flight has not been entered by all).
  Stragglers(const std::map<int, std::string>& snapshots, int last);

  int last() const { return last_; }
  // How many collectives the window holds (fewer than last() when the ranks ran fewer).
  int window() const { return static_cast<int>(timeline_.size()); }
  // The window's wall-clock start (the first entry into its first collectives) and length (to
  // the last entry into its last one).
  std::int64_t start_ns() const { return start_ns_; }
  double span_s() const { return span_s_; }
  // The ranks whose records were read, in rank order.
  const std::vector<int>& ranks() const { return ranks_; }
  // rank -> how long the others waited for it, summed over them (0 for every rank read).
  const std::map<int, double>& held_s() const { return held_s_; }
  // rank -> held_s as a share of the others' time in the window: held_s / ((ranks - 1) * span_s).
  const std::map<int, double>& share() const { return share_; }
  // rank -> in how many of the window's collectives it entered last.
  const std::map<int, int>& last_in() const { return last_in_; }
  // The rank that holds the others up (kMinShare, kLead, kMinWindow), if one does.
  std::optional<int> straggler() const { return straggler_; }
  const std::vector<WaitedCollective>& timeline() const { return timeline_; }
  // rank -> why its records could not be read (dead, no answer, no torch.distributed there).
  const std::map<int, std::string>& unread() const { return unread_; }

  // "rank 3 is the straggler: the others waited for it 38% of the time of the last 50
  // collectives (...)", or why no rank is named.
  std::string headline() const;
  // The headline, then one line per rank and the ranks that could not be read.
  std::string describe() const;

 private:
  int last_;
  std::int64_t start_ns_ = 0;
  double span_s_ = 0;
  std::vector<int> ranks_;
  int taking_part_ = 0;  // the ranks in the window's collectives
  std::map<int, double> held_s_;
  std::map<int, double> share_;
  std::map<int, int> last_in_;
  std::optional<int> straggler_;
  std::vector<WaitedCollective> timeline_;
  std::map<int, std::string> unread_;
};

}  // namespace ddip
