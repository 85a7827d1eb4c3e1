#include "ddip/collectives.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <utility>

namespace ddip {

namespace {

using nlohmann::json;

// One collective as a rank's snapshot lists it (python/ddip/rank/collectives.py's _entry()).
struct Entry {
  std::int64_t seq = 0;
  bool p2p = false;
  std::string pg;
  std::string op;
  std::vector<std::vector<std::int64_t>> sizes;
  std::vector<std::string> dtypes;
  bool done = false;
  std::int64_t created_ns = 0;
};

struct Snapshot {
  std::optional<std::string> off;  // why this rank has no collectives to show
  std::int64_t now_ns = 0;
  int world = 0;  // torch.distributed's world size, where the rank said
  std::map<std::string, std::vector<int>> groups;  // process group -> its ranks
  std::vector<Entry> entries;                      // oldest first
};

// A field's value, or `fallback` where it is missing or null; a value of another type throws
// nlohmann's type_error, which makes the whole snapshot unreadable.
template <class T>
T field(const json& j, const char* key, T fallback) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? fallback : it->get<T>();
}

// Process group -> its ranks; a group whose ranks are not a list of numbers is left out (its
// members are then the ranks that ran its collectives).
std::map<std::string, std::vector<int>> parse_groups(const json& j) {
  std::map<std::string, std::vector<int>> groups;
  auto it = j.find("groups");
  if (it == j.end() || !it->is_object()) return groups;
  for (const auto& [name, ranks] : it->items()) {
    if (!ranks.is_array()) continue;
    if (!std::all_of(ranks.begin(), ranks.end(),
                     [](const json& r) { return r.is_number_integer(); }))
      continue;
    groups[name] = ranks.get<std::vector<int>>();
  }
  return groups;
}

Entry parse_entry(const json& j) {
  Entry e;
  e.seq = field<std::int64_t>(j, "seq", 0);
  e.p2p = field<bool>(j, "p2p", false);
  e.pg = field<std::string>(j, "pg", "");
  e.op = field<std::string>(j, "op", "?");
  e.sizes = field<std::vector<std::vector<std::int64_t>>>(j, "sizes", {});
  e.dtypes = field<std::vector<std::string>>(j, "dtypes", {});
  e.done = field<bool>(j, "done", false);
  e.created_ns = field<std::int64_t>(j, "created_ns", 0);
  return e;
}

// A rank's snapshot, or one that is "off" saying why it could not be read.
Snapshot parse_snapshot(const std::string& text) {
  Snapshot s;
  try {
    json j = json::parse(text);
    if (!j.is_object())
      throw std::runtime_error("it is " + std::string(j.type_name()) + ", not an object");
    if (j.contains("off")) {
      s.off = j["off"].is_string() ? j["off"].get<std::string>() : j["off"].dump();
      return s;
    }
    s.now_ns = field<std::int64_t>(j, "now_ns", 0);
    s.world = field<int>(j, "world", 0);
    s.groups = parse_groups(j);
    for (const json& e : field<json>(j, "entries", json::array()))
      s.entries.push_back(parse_entry(e));
  } catch (const std::exception& e) {
    s = Snapshot{};
    s.off = std::string("its snapshot could not be read: ") + e.what();
  }
  return s;
}

// Torch's scalar type names as users write them.
std::string dtype_name(const std::string& torch_name) {
  static const std::map<std::string, std::string> names = {{"Float", "float32"},
                                                           {"Double", "float64"},
                                                           {"Half", "float16"},
                                                           {"BFloat16", "bfloat16"},
                                                           {"Long", "int64"},
                                                           {"Int", "int32"},
                                                           {"Short", "int16"},
                                                           {"Char", "int8"},
                                                           {"Byte", "uint8"},
                                                           {"Bool", "bool"},
                                                           {"ComplexFloat", "complex64"},
                                                           {"ComplexDouble", "complex128"}};
  auto it = names.find(torch_name);
  return it == names.end() ? torch_name : it->second;
}

// float32[1024], int64[2, 3]: what a collective was given.
std::string tensors(const Entry& e) {
  std::string out;
  for (std::size_t i = 0; i < std::min(e.dtypes.size(), e.sizes.size()); ++i) {
    if (!out.empty()) out += ", ";
    out += dtype_name(e.dtypes[i]) + "[";
    for (std::size_t d = 0; d < e.sizes[i].size(); ++d)
      out += (d ? ", " : "") + std::to_string(e.sizes[i][d]);
    out += "]";
  }
  return out.empty() ? "no tensors" : out;
}

std::string call(const Entry& e) {
  return e.op + " #" + std::to_string(e.seq) + " (" + tensors(e) + ")";
}

bool is_default_group(const std::string& pg) {
  return pg == "default_pg" || pg == "0" || pg.empty();
}

// " of group 'name'" after a collective; nothing for the default group.
std::string where(const std::string& pg) {
  return is_default_group(pg) ? "" : " of group '" + pg + "'";
}

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", s);
  return buf;
}

std::string ranks_text(const std::vector<int>& ranks) {
  if (ranks.size() == 1) return "rank " + std::to_string(ranks[0]);
  std::string out = "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

// One process group read across the ranks: the lowest pending collective, who waits in it, who
// has not entered it, who entered something else under its number.
class GroupReading {
 public:
  GroupReading(const std::map<int, Snapshot>& snapshots, std::string pg)
      : snapshots_(snapshots), pg_(std::move(pg)) {}

  std::map<int, std::pair<Entry, double>> waiting;  // rank -> its pending collective, seconds
  std::map<int, std::string> missing;               // rank -> the collective it has not entered
  std::set<int> mismatched;
  std::vector<std::string> findings;

  void read() {
    find_members();
    if (!find_reference()) return;
    find_waiters();
    compare();
    name_the_absent();
    name_the_differing();
    name_a_stall();
  }

 private:
  std::vector<const Entry*> entries(int rank) const {
    std::vector<const Entry*> out;
    for (const Entry& e : snapshots_.at(rank).entries)
      if (e.pg == pg_ && !e.p2p) out.push_back(&e);
    return out;
  }

  const Entry* pending_first(int rank) const {
    for (const Entry* e : entries(rank))
      if (!e->done) return e;
    return nullptr;
  }

  const Entry* at_seq(int rank) const {
    for (const Entry* e : entries(rank))
      if (e->seq == k_) return e;
    return nullptr;
  }

  bool in_group(int rank, const Snapshot& s) const {
    auto it = s.groups.find(pg_);
    if (it != s.groups.end() && !it->second.empty())
      return std::find(it->second.begin(), it->second.end(), rank) != it->second.end();
    return std::any_of(s.entries.begin(), s.entries.end(),
                       [&](const Entry& e) { return e.pg == pg_; });
  }

  void find_members() {
    for (const auto& [rank, s] : snapshots_)
      if (!s.off && in_group(rank, s)) members_.push_back(rank);
  }

  // The group's ranks that gave no collectives (dead, not asked, no answer): the members know
  // who belongs to the group (its ranks, or the world for the default group).
  std::vector<int> find_unheard() const {
    std::set<int> expected;
    for (int r : members_) {
      const Snapshot& s = snapshots_.at(r);
      auto it = s.groups.find(pg_);
      if (it != s.groups.end() && !it->second.empty())
        expected.insert(it->second.begin(), it->second.end());
      else if (is_default_group(pg_))
        for (int w = 0; w < s.world; ++w) expected.insert(w);
    }
    std::vector<int> unheard;
    for (int r : expected)
      if (std::find(members_.begin(), members_.end(), r) == members_.end()) unheard.push_back(r);
    return unheard;
  }

  std::string why_unheard(int rank) const {
    auto it = snapshots_.find(rank);
    std::string why = it != snapshots_.end() && it->second.off ? *it->second.off : "no answer";
    return "rank " + std::to_string(rank) + " (" + why + ")";
  }

  // The lowest pending sequence number among the members, and the first member's entry for it.
  bool find_reference() {
    for (int r : members_) {
      const Entry* e = pending_first(r);
      if (!e || (ref_ && e->seq >= k_)) continue;
      ref_ = e;
      k_ = e->seq;
    }
    return ref_ != nullptr;
  }

  void find_waiters() {
    for (int r : members_) {
      const Entry* e = pending_first(r);
      if (!e || e->seq != k_) continue;
      double s = std::max(0.0, double(snapshots_.at(r).now_ns - e->created_ns) / 1e9);
      waiters_.push_back(r);
      waiting[r] = {*e, s};
      longest_ = std::max(longest_, s);
    }
  }

  void compare() {
    for (int r : members_) {
      const Entry* mine = at_seq(r);
      if (!mine) {
        absent_.push_back(r);
        missing[r] = call(*ref_) + where(pg_);
      } else if (mine->op != ref_->op || mine->sizes != ref_->sizes ||
                 mine->dtypes != ref_->dtypes) {
        differ_.push_back(r);
      }
    }
  }

  // Ranks that stopped at the same collective share one line, in the order they first appear.
  void name_the_absent() {
    std::vector<std::pair<std::string, std::vector<int>>> by_last;
    for (int r : absent_) {
      auto mine = entries(r);
      std::string last =
          mine.empty() ? "" : mine.back()->op + " #" + std::to_string(mine.back()->seq);
      auto it =
          std::find_if(by_last.begin(), by_last.end(), [&](auto& p) { return p.first == last; });
      if (it == by_last.end()) it = by_last.insert(by_last.end(), {last, {}});
      it->second.push_back(r);
    }
    for (const auto& [last, ranks] : by_last) findings.push_back(absent_line(last, ranks));
  }

  std::string absent_line(const std::string& last, const std::vector<int>& ranks) const {
    bool one = ranks.size() == 1;
    std::string text = ranks_text(ranks) + (one ? " has" : " have") + " not entered " +
                       call(*ref_) + where(pg_) + ", which " + ranks_text(waiters_) +
                       (waiters_.size() == 1 ? " has" : " have") + " waited in for " +
                       seconds(longest_) + " s";
    if (!last.empty())
      return text + "; " + (one ? "its" : "their") + " last collective was " + last;
    return text + "; " + (one ? "it has" : "they have") + " run no collective in this group";
  }

  void name_the_differing() {
    if (differ_.empty()) return;
    std::set<int> involved(differ_.begin(), differ_.end());
    involved.insert(waiters_.begin(), waiters_.end());
    mismatched.insert(involved.begin(), involved.end());
    std::string calls;
    for (int r : involved) {
      const Entry* e = at_seq(r);
      calls += (calls.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + ": " +
               e->op + " " + tensors(*e);
    }
    findings.push_back("ranks disagree about collective #" + std::to_string(k_) + where(pg_) +
                       ": " + calls);
  }

  void name_a_stall() {
    if (!absent_.empty() || !differ_.empty() || waiters_.size() != members_.size()) return;
    std::vector<int> unheard = find_unheard();
    if (!unheard.empty()) {  // not a stall of every rank: some could not say where they are
      std::string who;
      for (int r : unheard) who += (who.empty() ? "" : ", ") + why_unheard(r);
      findings.push_back(ranks_text(waiters_) + (waiters_.size() == 1 ? " has" : " have") +
                         " waited " + seconds(longest_) + " s in " + call(*ref_) + where(pg_) +
                         "; the group's other " + (unheard.size() == 1 ? "rank" : "ranks") +
                         " could not say where " + (unheard.size() == 1 ? "it is" : "they are") +
                         ": " + who);
      return;
    }
    findings.push_back("every rank is in " + call(*ref_) + where(pg_) +
                       " and it has not completed after " + seconds(longest_) +
                       " s (a peer outside these ranks, or the network)");
  }

  const std::map<int, Snapshot>& snapshots_;
  std::string pg_;
  std::vector<int> members_, waiters_, absent_, differ_;
  const Entry* ref_ = nullptr;
  std::int64_t k_ = 0;
  double longest_ = 0;
};

std::string rank_line(
    int rank, const Snapshot& s,
    const std::map<int, std::pair<std::string, std::pair<Entry, double>>>& waits) {
  std::string text = "rank " + std::to_string(rank) + ": ";
  if (s.off) return text + *s.off;
  auto w = waits.find(rank);
  if (w == waits.end()) {
    text += "in no collective";
  } else {
    const auto& [pg, pending] = w->second;
    text += "waiting " + seconds(pending.second) + " s in " + call(pending.first) + where(pg);
  }
  const Entry* done = nullptr;
  for (const Entry& e : s.entries)
    if (e.done && !e.p2p) done = &e;
  if (done) text += "; last completed: " + done->op + " #" + std::to_string(done->seq);
  return text;
}

}  // namespace

CollectivePicture::CollectivePicture(const std::map<int, std::string>& texts) {
  std::map<int, Snapshot> snapshots;
  std::set<std::string> groups;
  for (const auto& [rank, text] : texts) {
    Snapshot& s = snapshots[rank] = parse_snapshot(text);
    known_ = known_ || !s.entries.empty();
    for (const Entry& e : s.entries) groups.insert(e.pg);
  }
  // rank -> (group, its pending collective and seconds): a rank waiting in two groups (or missing
  // from two) shows the last group read, in name order.
  std::map<int, std::pair<std::string, std::pair<Entry, double>>> waits;
  for (const std::string& pg : groups) {
    GroupReading g(snapshots, pg);
    g.read();
    for (auto& [r, w] : g.waiting) waits[r] = {pg, w};
    for (auto& [r, c] : g.missing) missing_from_[r] = c;
    mismatched_.insert(g.mismatched.begin(), g.mismatched.end());
    findings_.insert(findings_.end(), g.findings.begin(), g.findings.end());
  }
  for (const auto& [r, w] : waits) {
    waiting_in_[r] = call(w.second.first) + where(w.first);
    waited_s_[r] = w.second.second;
  }
  for (const auto& [rank, s] : snapshots) rank_lines_.push_back(rank_line(rank, s, waits));
}

namespace {
std::set<int> keys(const std::map<int, std::string>& m) {
  std::set<int> out;
  for (const auto& [rank, text] : m) out.insert(rank);
  return out;
}
}  // namespace

std::set<int> CollectivePicture::missing() const { return keys(missing_from_); }

std::set<int> CollectivePicture::waiting() const { return keys(waiting_in_); }

std::string CollectivePicture::describe() const {
  if (!known_) return "";
  std::string out = "collectives (torch's flight recorder):";
  for (const std::string& line : rank_lines_) out += "\n  " + line;
  for (const std::string& f : findings_) out += "\n=> " + f;
  return out;
}

}  // namespace ddip
