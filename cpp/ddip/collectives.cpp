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
  std::int64_t gen = 0;  // the recorder's process-group id: one per group made, a rebuild's anew
  bool p2p = false;
  std::string pg;
  std::string op;
  std::vector<std::vector<std::int64_t>> sizes;
  std::vector<std::string> dtypes;
  bool done = false;
  std::int64_t created_ns = 0;
};

// Where a rank's main thread is in the user's code (a cell, a script), as the rank read it.
struct Where {
  std::string file;
  std::int64_t line = 0;
  std::string function;
  std::string call;  // the callee of the call it is in there, as written ("time.sleep"), or ""
};

struct Snapshot {
  std::optional<std::string> off;  // why this rank has no collectives to show
  // A rank that is in no collective of any group: "left" (torch.distributed was shut down
  // there) or "uninitialized".
  std::optional<std::string> outside;
  std::vector<std::string> last_words;   // a dead rank's last lines of stderr
  std::optional<std::int64_t> since_ns;  // a dead rank: when the request it died in started
  std::optional<Where> at;               // where it is in the user's code, if in it
  std::int64_t now_ns = 0;
  int world = 0;                            // torch.distributed's world size, where the rank said
  std::map<std::string, GroupInfo> groups;  // the rank's live process groups
  std::vector<Entry> entries;               // the live groups' own, oldest first
};

// A field's value, or `fallback` where it is missing or null; a value of another type throws
// nlohmann's type_error, which makes the whole snapshot unreadable.
template <class T>
T field(const json& j, const char* key, T fallback) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? fallback : it->get<T>();
}

bool rank_list(const json& ranks) {
  return ranks.is_array() && std::all_of(ranks.begin(), ranks.end(),
                                         [](const json& r) { return r.is_number_integer(); });
}

}  // namespace

std::map<std::string, GroupInfo> read_groups(const json& j) {
  std::map<std::string, GroupInfo> groups;
  auto it = j.find("groups");
  if (it == j.end() || !it->is_object()) return groups;
  for (const auto& [name, g] : it->items()) {
    GroupInfo info;
    const json& ranks = g.is_object() ? g.value("ranks", json::array()) : g;
    if (!rank_list(ranks)) continue;
    info.ranks = ranks.get<std::vector<int>>();
    if (g.is_object() && g.contains("issued") && g["issued"].is_number_integer())
      info.issued = g["issued"].get<std::int64_t>();
    groups[name] = std::move(info);
  }
  return groups;
}

namespace {

// Only the records of the rank's live groups, each of its current generation (current_records).
void keep_current(Snapshot& s) {
  std::vector<RecordId> ids;
  for (const Entry& e : s.entries) ids.push_back({e.pg, e.gen, e.seq, e.p2p});
  std::vector<bool> keep = current_records(ids, s.groups);
  std::vector<Entry> kept;
  for (std::size_t i = 0; i < s.entries.size(); ++i)
    if (keep[i]) kept.push_back(std::move(s.entries[i]));
  s.entries = std::move(kept);
}

Entry parse_entry(const json& j) {
  Entry e;
  e.seq = field<std::int64_t>(j, "seq", 0);
  e.gen = field<std::int64_t>(j, "gen", 0);
  e.p2p = field<bool>(j, "p2p", false);
  e.pg = field<std::string>(j, "pg", "");
  e.op = field<std::string>(j, "op", "?");
  e.sizes = field<std::vector<std::vector<std::int64_t>>>(j, "sizes", {});
  e.dtypes = field<std::vector<std::string>>(j, "dtypes", {});
  e.done = field<bool>(j, "done", false);
  e.created_ns = field<std::int64_t>(j, "created_ns", 0);
  return e;
}

std::optional<Where> parse_where(const json& j) {
  auto it = j.find("where");
  if (it == j.end() || !it->is_object()) return std::nullopt;
  Where w;
  w.file = field<std::string>(*it, "file", "");
  w.line = field<std::int64_t>(*it, "line", 0);
  w.function = field<std::string>(*it, "function", "");
  w.call = field<std::string>(*it, "call", "");
  return w;
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
      s.last_words = field<std::vector<std::string>>(j, "last_words", {});
      if (j.contains("since_ns") && j["since_ns"].is_number_integer())
        s.since_ns = j["since_ns"].get<std::int64_t>();
      return s;
    }
    s.at = parse_where(j);
    if (j.contains("outside")) {
      s.outside = field<std::string>(j, "outside", "uninitialized");
      return s;
    }
    s.now_ns = field<std::int64_t>(j, "now_ns", 0);
    s.world = field<int>(j, "world", 0);
    s.groups = read_groups(j);
    for (const json& e : field<json>(j, "entries", json::array()))
      s.entries.push_back(parse_entry(e));
    keep_current(s);
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

// "at cell line 7, in time.sleep", "in step() at train.py:42": a line of a cell, or of a file
// by its name, in a function unless at a cell's (or script's) top level, and the call there.
std::string place(const Where& w) {
  std::string line;
  if (w.file.starts_with("<ipython-input-")) {
    line = "cell line " + std::to_string(w.line);
  } else {
    auto slash = w.file.rfind('/');
    line = (slash == std::string::npos ? w.file : w.file.substr(slash + 1)) + ":" +
           std::to_string(w.line);
  }
  std::string text = w.function.empty() || w.function == "<module>"
                         ? "at " + line
                         : "in " + w.function + "() at " + line;
  return w.call.empty() ? text : text + ", in " + w.call;
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

  // Whether the rank says it is in the group: the group's ranks list it, or (without a list) it
  // ran the group's collectives. Before its first collective a rank has no record of the group,
  // and its list is what makes it a member.
  bool in_group(int rank, const Snapshot& s) const {
    auto it = s.groups.find(pg_);
    if (it != s.groups.end() && !it->second.ranks.empty())
      return std::find(it->second.ranks.begin(), it->second.ranks.end(), rank) !=
             it->second.ranks.end();
    return std::any_of(s.entries.begin(), s.entries.end(),
                       [&](const Entry& e) { return e.pg == pg_; });
  }

  // The group's members: the ranks in it by their own word, and the ranks they list as the
  // group's that are outside torch.distributed (left it, or never in it): those are in no
  // collective, so surely not in the one the others wait in.
  void find_members() {
    for (const auto& [rank, s] : snapshots_)
      if (!s.off && !s.outside && in_group(rank, s)) members_.push_back(rank);
    expected_ = expected();
    for (const auto& [rank, s] : snapshots_)
      if (s.outside && expected_.count(rank)) members_.push_back(rank);
    std::sort(members_.begin(), members_.end());
  }

  // Who belongs to the group by its members' word: its ranks, or the world for the default group.
  std::set<int> expected() const {
    std::set<int> out;
    for (int r : members_) {
      const Snapshot& s = snapshots_.at(r);
      auto it = s.groups.find(pg_);
      if (it != s.groups.end() && !it->second.ranks.empty())
        out.insert(it->second.ranks.begin(), it->second.ranks.end());
      else if (is_default_group(pg_))
        for (int w = 0; w < s.world; ++w) out.insert(w);
    }
    return out;
  }

  // The group's ranks that gave no collectives (dead, not asked, no answer).
  std::vector<int> find_unheard() const {
    std::vector<int> unheard;
    for (int r : expected_)
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
      const auto& outside = snapshots_.at(r).outside;
      std::string last = outside        ? "\n" + *outside
                         : mine.empty() ? ""
                                        : mine.back()->op + " #" + std::to_string(mine.back()->seq);
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
    if (last == "\nleft")
      text += std::string("; ") + (one ? "it has" : "they have") +
              " left torch.distributed (destroy_process_group)";
    else if (last.starts_with("\n"))
      text += std::string("; torch.distributed is not initialized ") + (one ? "in it" : "in them");
    else if (!last.empty())
      text += std::string("; ") + (one ? "its" : "their") + " last collective was " + last;
    else
      text +=
          std::string("; ") + (one ? "it has" : "they have") + " run no collective in this group";
    const auto& at = snapshots_.at(ranks[0]).at;
    return one && at ? text + "; it is " + place(*at) : text;
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
  std::set<int> expected_;
  const Entry* ref_ = nullptr;
  std::int64_t k_ = 0;
  double longest_ = 0;
};

std::string rank_line(
    int rank, const Snapshot& s,
    const std::map<int, std::pair<std::string, std::pair<Entry, double>>>& waits) {
  std::string text = "rank " + std::to_string(rank) + ": ";
  if (s.off) return text + *s.off;
  std::string at = s.at ? "; " + place(*s.at) : "";
  if (s.outside)
    return text +
           (*s.outside == "left" ? "has left torch.distributed (destroy_process_group)"
                                 : "torch.distributed is not initialized") +
           at;
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
  if (w == waits.end()) text += at;  // not where the others wait: where it is instead
  return text;
}

// The last lines a dead rank wrote, as one: what killed it says why (gloo's EnforceNotMet names
// the sizes that did not match).
std::string last_words(const std::vector<std::string>& lines) {
  std::vector<std::string> kept;
  for (auto it = lines.rbegin(); it != lines.rend() && kept.size() < 2; ++it) {
    std::string line = *it;
    line.erase(0, line.find_first_not_of(" \t"));
    line.erase(line.find_last_not_of(" \t\r\n") + 1);
    if (!line.empty()) kept.insert(kept.begin(), line);
  }
  std::string out;
  for (const std::string& line : kept) out += (out.empty() ? "" : " ") + line;
  return out;
}

// A rank that died, read from the survivors' records and its own last words: where each
// survivor was (its newest collective; one issued since the request it died in began, where the
// kernel says when that was), then what the dead rank said. A rank-dependent shape or dtype ends
// so under gloo: the rank that receives more than it expects aborts. "" when no survivor was in
// a collective then.
std::string dead_line(int rank, const Snapshot& dead, const std::map<int, Snapshot>& snapshots) {
  std::string where_they_were;
  for (const auto& [r, s] : snapshots) {
    const Entry* newest = nullptr;
    for (const Entry& e : s.entries)
      if (!e.p2p && (!newest || e.created_ns >= newest->created_ns)) newest = &e;
    if (newest && (!dead.since_ns || newest->created_ns >= *dead.since_ns))
      where_they_were += "; rank " + std::to_string(r) + "'s last collective: " + call(*newest) +
                         where(newest->pg);
  }
  if (where_they_were.empty()) return "";
  std::string why = *dead.off;
  if (why.starts_with("dead: ")) why.erase(0, 6);
  return "rank " + std::to_string(rank) + " died (" + why + ")" + where_they_were + "; rank " +
         std::to_string(rank) + "'s last words: " + last_words(dead.last_words);
}

}  // namespace

std::vector<bool> current_records(const std::vector<RecordId>& records,
                                  const std::map<std::string, GroupInfo>& groups) {
  std::map<std::string, std::int64_t> newest;
  for (const RecordId& r : records) {
    auto it = newest.try_emplace(r.pg, r.gen).first;
    it->second = std::max(it->second, r.gen);
  }
  std::map<std::string, bool> history;  // group -> its newest generation is history too
  for (const auto& [pg, gen] : newest) {
    auto g = groups.find(pg);
    if (g == groups.end()) {
      history[pg] = !groups.empty();
      continue;
    }
    std::int64_t highest = 0;
    for (const RecordId& r : records)
      if (r.pg == pg && r.gen == gen && !r.p2p) highest = std::max(highest, r.seq);
    history[pg] = g->second.issued && highest > *g->second.issued;
  }
  std::vector<bool> keep;
  keep.reserve(records.size());
  for (const RecordId& r : records) keep.push_back(!history[r.pg] && r.gen == newest[r.pg]);
  return keep;
}

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
  for (const auto& [rank, s] : snapshots)
    if (s.off && !s.last_words.empty())
      if (std::string line = dead_line(rank, s, snapshots); !line.empty())
        findings_.push_back(line);
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
