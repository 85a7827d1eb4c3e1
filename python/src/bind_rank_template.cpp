#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "ddip/rank_template.hpp"
#include "slices.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

const char* state_name(ddip::RankTemplate::State s) {
  switch (s) {
    case ddip::RankTemplate::State::kNone:
      return "none";
    case ddip::RankTemplate::State::kStarting:
      return "starting";
    case ddip::RankTemplate::State::kReady:
      return "ready";
    case ddip::RankTemplate::State::kFailed:
      return "failed";
    case ddip::RankTemplate::State::kDead:
      return "dead";
  }
  return "?";
}

// (state, pid, detail): detail is the template's own payload (bytes) or the kernel's reason.
nb::tuple status_tuple(const ddip::RankTemplate::Status& s) {
  return nb::make_tuple(state_name(s.state), s.pid, nb::bytes(s.detail.data(), s.detail.size()));
}

}  // namespace

void init_rank_template(nb::module_& m) {
  nb::exception<ddip::EndOfKernel>(m, "EndOfKernel", PyExc_EOFError);

  nb::class_<ddip::RankTemplate>(m, "RankTemplate",
                                 "Kernel side of the warm rank template: starts it from a thread "
                                 "that lives as long as this object, forks ranks from it.")
      .def(nb::init<>())
      .def(
          "start",
          [](ddip::RankTemplate& t, const std::vector<std::string>& argv,
             const std::vector<std::string>& env, const std::string& cwd) {
            ddip::SpawnSpec s{argv, env, cwd, true};
            nb::gil_scoped_release release;
            t.start(std::move(s));
          },
          "argv"_a, "env"_a, "cwd"_a = "")
      .def(
          "stop",
          [](ddip::RankTemplate& t, const std::string& why) {
            nb::gil_scoped_release release;
            t.stop(why);
          },
          "why"_a)
      .def("status", [](const ddip::RankTemplate& t) { return status_tuple(t.status()); })
      .def(
          "wait_ready",
          [](const ddip::RankTemplate& t, double timeout_ms) {
            auto s = ddip_python::wait_in_slices<ddip::RankTemplate::Status>(
                timeout_ms, [&](std::chrono::milliseconds slice) {
                  auto st = t.wait_ready(slice);
                  return st.state == ddip::RankTemplate::State::kStarting
                             ? std::nullopt
                             : std::optional<ddip::RankTemplate::Status>(st);
                });
            return status_tuple(s ? *s : t.status());
          },
          "timeout_ms"_a)
      .def_prop_ro("last_error", &ddip::RankTemplate::last_error)
      .def_prop_ro("forks", &ddip::RankTemplate::forks)
      .def_prop_ro("refusals", &ddip::RankTemplate::refusals);

  nb::class_<ddip::ForkServer::Request>(m, "ForkRequest")
      .def_ro("argv", &ddip::ForkServer::Request::argv)
      .def_ro("env", &ddip::ForkServer::Request::env)
      .def_ro("cwd", &ddip::ForkServer::Request::cwd);

  nb::class_<ddip::ForkServer>(m, "ForkServer",
                               "Template side: serves the kernel's fork requests. Forks only "
                               "while this process is single-threaded.")
      .def(
          "__init__",
          [](ddip::ForkServer* self, const std::string& path) {
            nb::gil_scoped_release release;
            new (self) ddip::ForkServer(path);
          },
          "socket_path"_a)
      .def(
          "ready",
          [](ddip::ForkServer& s, const nb::bytes& info) {
            s.ready(std::string(info.c_str(), info.size()));
          },
          "info"_a)
      .def(
          "failed",
          [](ddip::ForkServer& s, const nb::bytes& why) {
            s.failed(std::string(why.c_str(), why.size()));
          },
          "why"_a)
      .def(
          "next",
          [](ddip::ForkServer& s, double timeout_ms) -> nb::object {
            // A signal ends next()'s wait (the template has one thread: it gets them all), so
            // an idle template need not wake to look for one.
            auto r = ddip_python::wait_in_slices<ddip::ForkServer::Request>(
                timeout_ms, [&](std::chrono::milliseconds slice) { return s.next(slice); },
                ddip_python::kInterruptibleSlice);
            if (!r) return nb::none();
            return nb::cast(std::move(*r));
          },
          "timeout_ms"_a,
          "A ForkRequest, or None on timeout; EndOfKernel (EOFError) once the kernel is gone.")
      .def(
          "fork",
          [](ddip::ForkServer& s, ddip::ForkServer::Request& r) -> nb::object {
            // Python's own fork protocol around ours: its locks, its at-fork hooks (random's
            // reseed, threading's reset) run as they would for os.fork().
            PyOS_BeforeFork();
            pid_t pid;
            try {
              pid = s.fork(r);
            } catch (...) {
              PyOS_AfterFork_Parent();
              throw;
            }
            if (pid == 0) {
              PyOS_AfterFork_Child();
              return nb::make_tuple(0, nb::make_tuple(r.argv, r.env, r.cwd));
            }
            PyOS_AfterFork_Parent();
            return nb::make_tuple(pid, nb::none());
          },
          "request"_a,
          "Parent: (pid, None). Child: (0, (argv, env, cwd)), set up as a rank of the kernel.")
      .def("refuse", &ddip::ForkServer::refuse, "request"_a, "why"_a)
      .def_prop_ro("closed", &ddip::ForkServer::closed);
}
