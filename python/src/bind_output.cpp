#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "ddip/output.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {
// Each piece as (ranks, stream, text): ranks sorted, stream 1 (stdout) or 2 (stderr).
nb::list pieces(std::vector<ddip::Repeats::Piece> out) {
  nb::list list;
  for (auto& p : out) list.append(nb::make_tuple(p.ranks, p.stream, p.text));
  return list;
}
}  // namespace

void init_output(nb::module_& m) {
  m.attr("REPEAT_WINDOW_S") = ddip::kRepeatWindowS;
  m.def("rank_ranges", &ddip::rank_ranges, "ranks"_a,
        "Ranks as one reads them at scale: sorted, runs of three or more as ranges (\"0,2,4-7\").");
  nb::class_<ddip::Repeats>(m, "Repeats",
                            "Repeats collapse, with the ranks named: the rule of "
                            "cpp/ddip/output.hpp. Each call returns what to write now, as "
                            "(ranks, stream, text) tuples; times are time.monotonic() seconds.")
      .def(nb::init<std::vector<int>, double>(), "ranks"_a, "window"_a)
      .def(
          "feed",
          [](ddip::Repeats& r, int rank, int stream, const std::string& text, double now) {
            return pieces(r.feed(rank, stream, text, now));
          },
          "rank"_a, "stream"_a, "text"_a, "now"_a)
      .def(
          "done", [](ddip::Repeats& r, int rank, double now) { return pieces(r.done(rank, now)); },
          "rank"_a, "now"_a)
      .def(
          "release",
          [](ddip::Repeats& r, double now, bool everything) {
            return pieces(r.release(now, everything));
          },
          "now"_a, "everything"_a = false)
      .def("next_due", &ddip::Repeats::next_due,
           "When release() next has lines to write, or None while nothing is held.");
}
