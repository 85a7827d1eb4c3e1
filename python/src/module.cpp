// The ddip._core extension: one init_<module> per runtime module, called in order.
#include <nanobind/nanobind.h>

#include <cstdio>
#include <system_error>

#include "ddip/channel.hpp"
#include "ddip/output.hpp"

namespace nb = nanobind;

void init_coordinator(nb::module_& m);
void init_endpoint(nb::module_& m);
void init_rank_template(nb::module_& m);
void init_host_agent(nb::module_& m);
void init_plan(nb::module_& m);
void init_keeper(nb::module_& m);
void init_collectives(nb::module_& m);
void init_output(nb::module_& m);
void init_stragglers(nb::module_& m);

NB_MODULE(_core, m) {
  m.doc() = "ddip's C++ runtime: process supervision, framed messaging, output capture";
  // Runtime errors carry errno: surface them as OSError with the call and what we were doing.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const std::system_error& e) {
      PyErr_SetObject(PyExc_OSError, nb::make_tuple(e.code().value(), e.what()).ptr());
    }
  });
  m.attr("HELLO") = static_cast<int>(ddip::kHello);
  m.attr("REQUEST") = static_cast<int>(ddip::kRequest);
  m.attr("DONE") = static_cast<int>(ddip::kDone);
  m.attr("DISPLAY") = static_cast<int>(ddip::kDisplay);
  m.attr("SHUTDOWN") = static_cast<int>(ddip::kShutdown);
  m.attr("MESSAGE") = static_cast<int>(ddip::kMessage);
  m.attr("RELEASE") = static_cast<int>(ddip::kRelease);
  m.attr("STACK_REQUEST") = static_cast<int>(ddip::kStackRequest);
  m.attr("ABORT_REQUEST") = static_cast<int>(ddip::kAbortRequest);
  m.attr("STACKS") = static_cast<int>(ddip::kStacks);
  m.attr("COLLECTIVES_REQUEST") = static_cast<int>(ddip::kCollectivesRequest);
  m.attr("COLLECTIVES") = static_cast<int>(ddip::kCollectives);
  m.attr("MAX_FDS") = ddip::kMaxFdsPerFrame;
  // C stdio buffers (printf from a C extension) are flushed before a reply and before exit, so
  // that output is in the pipe before "done" says the request's output is complete.
  m.def(
      "flush_stdio", [] { std::fflush(nullptr); }, "fflush(NULL): flushes every C stdio stream.");
  m.attr("DISPLAY_MARKER") = nb::bytes(ddip::kDisplayMarker.data(), ddip::kDisplayMarker.size());
  init_rank_template(m);
  init_keeper(m);
  init_coordinator(m);
  init_endpoint(m);
  init_host_agent(m);
  init_plan(m);
  init_collectives(m);
  init_output(m);
  init_stragglers(m);
}
