#include "ddip/stragglers.hpp"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <tuple>
#include <utility>

#include "ddip/collectives.hpp"

namespace ddip {

namespace {

using nlohmann::json;

// One "entered" record: [process group, generation (the recorder's pg id), sequence number, op,
// time_created_ns], as python/ddip/rank/collectives.py's snapshot() writes it (p2p left out).
struct Record {
  std::string pg;
  std::int64_t gen = 0;
  std::int64_t seq = 0;
  std::string op;
  std::int64_t entered_ns = 0;
};

// One rank's records, or why there are none to read.
struct RankRecords {
  std::optional<std::string> unread;
  std::map<std::string, GroupInfo> groups;
  std::vector<Record> records;
};

// The records of each live group's current generation only (current_records, the rule
// CollectivePicture reads by): after a heal, the rebuilt group's, numbered from #1 again.
void keep_current(RankRecords& r) {
  std::vector<RecordId> ids;
  for (const Record& e : r.records) ids.push_back({e.pg, e.gen, e.seq, false});
  std::vector<bool> keep = current_records(ids, r.groups);
  std::vector<Record> kept;
  for (std::size_t i = 0; i < r.records.size(); ++i)
    if (keep[i]) kept.push_back(std::move(r.records[i]));
  r.records = std::move(kept);
}

RankRecords parse_rank(const std::string& text) {
  RankRecords r;
  try {
    json j = json::parse(text);
    if (!j.is_object())
      throw std::runtime_error("it is " + std::string(j.type_name()) + ", not an object");
    if (j.contains("off")) {
      r.unread = j["off"].is_string() ? j["off"].get<std::string>() : j["off"].dump();
      return r;
    }
    if (j.contains("outside")) {
      r.unread = j["outside"] == "left" ? "it has left torch.distributed"
                                        : "torch.distributed is not initialized there";
      return r;
    }
    auto entered = j.find("entered");
    if (entered == j.end() || !entered->is_array()) {
      r.unread = "its snapshot has no entry times (a rank running another version of ddip)";
      return r;
    }
    r.groups = read_groups(j);
    for (const json& e : *entered) {
      if (!e.is_array() || e.size() != 5)
        throw std::runtime_error("an entered record is not [pg, gen, seq, op, ns]: " + e.dump());
      r.records.push_back(Record{e[0].get<std::string>(), e[1].get<std::int64_t>(),
                                 e[2].get<std::int64_t>(), e[3].get<std::string>(),
                                 e[4].get<std::int64_t>()});
    }
    keep_current(r);
  } catch (const std::exception& e) {
    r = RankRecords{};
    r.unread = std::string("its snapshot could not be read: ") + e.what();
  }
  return r;
}

// A collective as the ranks recorded it: rank -> when it entered.
struct Entries {
  std::string op;
  std::map<int, std::int64_t> entered_ns;
};

std::string seconds(double s) {
  char buf[32];
  if (s >= 1 || s == 0)
    std::snprintf(buf, sizeof buf, "%.2f s", s);
  else
    std::snprintf(buf, sizeof buf, "%.1f ms", s * 1e3);
  return buf;
}

std::string percent(double share) {
  if (share > 0 && share < 0.005) return "<1%";
  char buf[16];
  std::snprintf(buf, sizeof buf, "%.0f%%", share * 100);
  return buf;
}

std::string collectives(int n) {
  return std::to_string(n) + (n == 1 ? " collective" : " collectives");
}

}  // namespace

Stragglers::Stragglers(const std::map<int, std::string>& snapshots, int last) : last_(last) {
  if (last < 1)
    throw std::invalid_argument("last=" + std::to_string(last) +
                                ": the number of collectives to look at must be 1 or more");
  std::map<int, RankRecords> read;
  for (const auto& [rank, text] : snapshots) {
    RankRecords r = parse_rank(text);
    if (r.unread)
      unread_[rank] = *r.unread;
    else
      read.emplace(rank, std::move(r));
  }
  for (const auto& [rank, r] : read) {
    ranks_.push_back(rank);
    held_s_[rank] = 0;
    share_[rank] = 0;
    last_in_[rank] = 0;
  }

  // Who is in each group: as the ranks list it, else whoever recorded its collectives; only the
  // ranks read can be waited for or waiting.
  std::map<std::string, std::set<int>> members;
  for (const auto& [rank, r] : read)
    for (const auto& [pg, g] : r.groups)
      for (int m : g.ranks)
        if (read.count(m)) members[pg].insert(m);
  std::map<std::pair<std::string, std::int64_t>, Entries> by_collective;
  for (const auto& [rank, r] : read)
    for (const Record& e : r.records) {
      Entries& c = by_collective[{e.pg, e.seq}];
      c.op = e.op;
      c.entered_ns[rank] = e.entered_ns;
      if (r.groups.count(e.pg) == 0) members[e.pg].insert(rank);
    }

  // The collectives every member entered, in the order their last rank did.
  struct Complete {
    std::int64_t last_ns;
    const std::pair<std::string, std::int64_t>* key;
    const Entries* entries;
  };
  std::vector<Complete> complete;
  for (const auto& [key, c] : by_collective) {
    const std::set<int>& m = members[key.first];
    if (m.size() < 2 ||
        !std::all_of(m.begin(), m.end(), [&](int rank) { return c.entered_ns.count(rank) > 0; }))
      continue;
    std::int64_t latest = 0;
    for (int rank : m) latest = std::max(latest, c.entered_ns.at(rank));
    complete.push_back({latest, &key, &c});
  }
  std::sort(complete.begin(), complete.end(), [](const Complete& a, const Complete& b) {
    return std::tie(a.last_ns, *a.key) < std::tie(b.last_ns, *b.key);
  });
  if (complete.size() > static_cast<std::size_t>(last))
    complete.erase(complete.begin(), complete.end() - last);
  if (complete.empty()) return;

  start_ns_ = complete.back().last_ns;
  std::set<int> taking_part;
  for (const Complete& c : complete)
    for (int rank : members[c.key->first]) {
      start_ns_ = std::min(start_ns_, c.entries->entered_ns.at(rank));
      taking_part.insert(rank);
    }
  taking_part_ = static_cast<int>(taking_part.size());
  span_s_ = static_cast<double>(complete.back().last_ns - start_ns_) / 1e9;
  std::map<int, std::int64_t> waited_until;  // rank -> the end of its waits counted so far
  for (const Complete& c : complete) {
    WaitedCollective w;
    w.pg = c.key->first;
    w.seq = c.key->second;
    w.op = c.entries->op;
    w.at_s = static_cast<double>(c.last_ns - start_ns_) / 1e9;
    for (int rank : members[w.pg]) {  // the first of the ranks that entered last is named
      std::int64_t t = c.entries->entered_ns.at(rank);
      if (w.last < 0 || t > c.entries->entered_ns.at(w.last)) w.last = rank;
    }
    // A rank waits in one collective at a time: where its collectives overlap (asynchronous
    // ones, DDP's buckets), a stretch of its time counts once, for the collective whose last
    // rank came first. Synchronous collectives never overlap, and count in full.
    for (int rank : members[w.pg]) {
      std::int64_t from = std::max(c.entries->entered_ns.at(rank), waited_until[rank]);
      if (c.last_ns > from) w.wait_s += static_cast<double>(c.last_ns - from) / 1e9;
      waited_until[rank] = std::max(waited_until[rank], c.last_ns);
    }
    held_s_[w.last] += w.wait_s;
    last_in_[w.last] += 1;
    timeline_.push_back(std::move(w));
  }

  // Each other rank's time in the window is span_s: the share is of all of theirs together.
  double others_time = static_cast<double>(taking_part_ - 1) * span_s_;
  if (others_time <= 0) return;
  for (auto& [rank, share] : share_) share = held_s_[rank] / others_time;
  int top = ranks_.front();
  for (int rank : ranks_)
    if (held_s_[rank] > held_s_[top]) top = rank;
  double runner_up = 0;
  for (int rank : ranks_)
    if (rank != top) runner_up = std::max(runner_up, held_s_[rank]);
  if (window() >= kMinWindow && held_s_[top] > 0 && share_[top] >= kMinShare &&
      held_s_[top] >= kLead * runner_up)
    straggler_ = top;
}

std::string Stragglers::headline() const {
  if (timeline_.empty()) {
    if (ranks_.empty())
      return "no straggler named: no rank's collectives could be read" +
             (unread_.empty() ? std::string()
                              : " (rank " + std::to_string(unread_.begin()->first) + ": " +
                                    unread_.begin()->second + ")");
    return "no straggler named: the flight recorder holds no collective that every rank of its "
           "group has entered";
  }
  std::string recent = "the last " + collectives(window());
  if (straggler_) {
    int r = *straggler_;
    double others = static_cast<double>(taking_part_ - 1);
    return "rank " + std::to_string(r) + " is the straggler: the others waited for it " +
           percent(share_.at(r)) + " of the time of " + recent + " (" +
           seconds(held_s_.at(r) / others) + " of " + seconds(span_s_) + " each, on average)";
  }
  int top = ranks_.front();
  for (int rank : ranks_)
    if (held_s_.at(rank) > held_s_.at(top)) top = rank;
  if (window() < kMinWindow)
    return "no straggler named: it takes " + collectives(kMinWindow) +
           " to tell one, and the window holds " + collectives(window()) + " (the most: rank " +
           std::to_string(top) + ", " + percent(share_.at(top)) + " of the others' time)";
  return "no straggler in " + recent + ": no rank held the others up for " + percent(kMinShare) +
         " of their time and twice as long as any other (the most: rank " + std::to_string(top) +
         ", " + percent(share_.at(top)) + ")";
}

std::string Stragglers::describe() const {
  std::string out = headline();
  if (!timeline_.empty())
    for (int rank : ranks_)
      out += "\n  rank " + std::to_string(rank) + ": the others waited " +
             seconds(held_s_.at(rank)) + " for it (" + percent(share_.at(rank)) +
             " of their time); it entered " + std::to_string(last_in_.at(rank)) + " of " +
             collectives(window()) + " last";
  for (const auto& [rank, why] : unread_)
    out += "\n  rank " + std::to_string(rank) + ": not read (" + why + ")";
  return out;
}

}  // namespace ddip
