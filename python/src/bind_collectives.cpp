// ddip._core.CollectivePicture: the picture of a hang by collective (cpp/ddip/collectives.hpp),
// the one copy of the rule; python/ddip/kernel/collectives.py hands it the ranks' snapshots.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/set.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "ddip/collectives.hpp"

namespace nb = nanobind;
using namespace nb::literals;

void init_collectives(nb::module_& m) {
  nb::class_<ddip::CollectivePicture>(m, "CollectivePicture")
      .def(nb::init<const std::map<int, std::string>&>(), "snapshots"_a,
           "rank -> that rank's snapshot as JSON text (rank/collectives.py's snapshot()).")
      .def_prop_ro("known", &ddip::CollectivePicture::known)
      .def("describe", &ddip::CollectivePicture::describe)
      .def("rank_lines", &ddip::CollectivePicture::rank_lines)
      .def_prop_ro("findings", &ddip::CollectivePicture::findings)
      .def_prop_ro("missing", &ddip::CollectivePicture::missing)
      .def_prop_ro("waiting", &ddip::CollectivePicture::waiting)
      .def_prop_ro("mismatched", &ddip::CollectivePicture::mismatched)
      .def_prop_ro("missing_from", &ddip::CollectivePicture::missing_from)
      .def_prop_ro("waiting_in", &ddip::CollectivePicture::waiting_in)
      .def_prop_ro("waited_s", &ddip::CollectivePicture::waited_s);
}
