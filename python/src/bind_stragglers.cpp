// ddip._core.Stragglers: who the others waited for in the last collectives
// (cpp/ddip/stragglers.hpp), the one copy of the rule; python/ddip/kernel/stragglers.py hands it
// the ranks' snapshots.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "ddip/stragglers.hpp"

namespace nb = nanobind;
using namespace nb::literals;

void init_stragglers(nb::module_& m) {
  nb::class_<ddip::WaitedCollective>(m, "WaitedCollective")
      .def_ro("pg", &ddip::WaitedCollective::pg)
      .def_ro("seq", &ddip::WaitedCollective::seq)
      .def_ro("op", &ddip::WaitedCollective::op)
      .def_ro("at_s", &ddip::WaitedCollective::at_s)
      .def_ro("last", &ddip::WaitedCollective::last)
      .def_ro("wait_s", &ddip::WaitedCollective::wait_s);
  nb::class_<ddip::Stragglers>(m, "Stragglers")
      .def(nb::init<const std::map<int, std::string>&, int>(), "snapshots"_a, "last"_a,
           "rank -> that rank's snapshot as JSON text (rank/collectives.py's snapshot()); the "
           "number of most recent collectives to look at (ValueError below 1).")
      .def_ro_static("MIN_SHARE", &ddip::Stragglers::kMinShare)
      .def_ro_static("LEAD", &ddip::Stragglers::kLead)
      .def_prop_ro("last", &ddip::Stragglers::last)
      .def_prop_ro("window", &ddip::Stragglers::window)
      .def_prop_ro("start_ns", &ddip::Stragglers::start_ns)
      .def_prop_ro("span_s", &ddip::Stragglers::span_s)
      .def_prop_ro("ranks", &ddip::Stragglers::ranks)
      .def_prop_ro("held_s", &ddip::Stragglers::held_s)
      .def_prop_ro("share", &ddip::Stragglers::share)
      .def_prop_ro("last_in", &ddip::Stragglers::last_in)
      .def_prop_ro("straggler", &ddip::Stragglers::straggler)
      .def_prop_ro("timeline", &ddip::Stragglers::timeline)
      .def_prop_ro("unread", &ddip::Stragglers::unread)
      .def("headline", &ddip::Stragglers::headline)
      .def("describe", &ddip::Stragglers::describe);
}
