#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "ddip/keeper.hpp"

namespace nb = nanobind;
using namespace nb::literals;

void init_keeper(nb::module_& m) {
  nb::class_<ddip::AgentKeeper>(m, "AgentKeeper",
                                "The kernel's standing host agents: each host's launcher and "
                                "agent (and the host's rank template) kept across groups, from a "
                                "thread that lives as long as this object.")
      .def(
          "__init__",
          [](ddip::AgentKeeper* self, int stop_grace_ms) {
            new (self) ddip::AgentKeeper(std::chrono::milliseconds(stop_grace_ms));
          },
          "stop_grace_ms"_a = 5000)
      .def(
          "release",
          [](ddip::AgentKeeper& k, int timeout_ms) {
            nb::gil_scoped_release release;
            return k.release(std::chrono::milliseconds(timeout_ms));
          },
          "timeout_ms"_a = 5000,
          "Lets every idle agent go (and each busy one when its group ends), waiting up to "
          "timeout_ms for them; how many were idle.")
      .def_prop_ro("launchers", [](const ddip::AgentKeeper& k) {
        auto pids = k.launchers();
        return std::vector<int>(pids.begin(), pids.end());
      });
}
