#include <fcntl.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "ddip/endpoint.hpp"
#include "slices.hpp"

namespace nb = nanobind;
using namespace nb::literals;

void init_endpoint(nb::module_& m) {
  nb::exception<ddip::EndpointClosed>(m, "EndpointClosed", PyExc_ConnectionError);
  nb::class_<ddip::Endpoint>(m, "Endpoint",
                             "Worker side of a group: frames to and from the kernel, with a "
                             "watchdog thread that answers heartbeats and exits with the kernel.")
      .def(
          "__init__",
          [](ddip::Endpoint* self, const std::string& path, int rank, const nb::bytes& hello,
             int exit_grace_ms) {
            std::string h(hello.c_str(), hello.size());
            auto options = ddip::EndpointOptions::from_environment();
            options.exit_grace = std::chrono::milliseconds(exit_grace_ms);
            nb::gil_scoped_release release;
            new (self) ddip::Endpoint(path, rank, std::move(h), options);
          },
          "socket_path"_a, "rank"_a, "hello"_a, "exit_grace_ms"_a = 3000,
          "DDIP_KERNEL_PID and DDIP_KERNEL_TIMEOUT_MS, when set, tie this process (and its "
          "process group, when it leads one) to the kernel's life.")
      .def_prop_ro("rank", &ddip::Endpoint::rank)
      .def_prop_ro("closed", &ddip::Endpoint::closed)
      .def(
          "send",
          [](ddip::Endpoint& e, int kind, uint64_t seq, const nb::bytes& payload,
             const std::vector<int>& fds) {
            ddip::Frame f = ddip::Frame::make(static_cast<uint16_t>(kind), e.rank(), seq,
                                              std::string(payload.c_str(), payload.size()));
            if (!fds.empty()) {
              // The frame owns copies; the caller keeps (and closes) its own fds.
              f.fds = std::make_shared<std::vector<ddip::Fd>>();
              for (int fd : fds)
                f.fds->emplace_back(ddip::check(::fcntl(fd, F_DUPFD_CLOEXEC, 0),
                                                "fcntl(F_DUPFD_CLOEXEC)",
                                                "passing an fd to the kernel"));
            }
            nb::gil_scoped_release release;
            e.send(std::move(f));
          },
          "kind"_a, "seq"_a, "payload"_a, "fds"_a = std::vector<int>{})
      .def(
          "recv",
          [](ddip::Endpoint& e, double timeout_ms) -> nb::object {
            // A signal ends recv()'s wait: an idle rank wakes only for frames (and once a second).
            auto f = ddip_python::wait_in_slices<ddip::Frame>(
                timeout_ms, [&](std::chrono::milliseconds slice) { return e.recv(slice); },
                ddip_python::kInterruptibleSlice);
            if (!f) return nb::none();
            const std::string& d = f->data();
            // Received fds (shared-memory segments) are handed to Python, which closes them.
            // `truncated`: some did not arrive (this process is out of fds).
            nb::list fds;
            if (f->fds)
              for (auto& fd : *f->fds) fds.append(fd.release());
            return nb::make_tuple(static_cast<int>(f->kind), f->seq, nb::bytes(d.data(), d.size()),
                                  fds, f->truncated);
          },
          "timeout_ms"_a,
          "(kind, seq, payload, fds, truncated), or None after timeout_ms (negative: forever).")
      .def(
          "enable_stack_dumps",
          [](ddip::Endpoint& e, int signum, int read_fd) {
            e.enable_stack_dumps(signum, ddip::Fd(read_fd));
          },
          "signum"_a, "read_fd"_a,
          "Stack requests are answered with what is written to the pipe read_fd when this process "
          "gets signum (faulthandler.register(signum, file=<write end>, all_threads=True)). The "
          "Endpoint owns read_fd from now on. The handler now installed for signum is kept: put "
          "back where other code resets it to SIG_DFL or SIG_IGN.")
      .def(
          "enable_collectives",
          [](ddip::Endpoint& e, int write_fd) { e.enable_collectives(ddip::Fd(write_fd)); },
          "write_fd"_a,
          "Collectives requests are written to the pipe write_fd (each one's seq, 8 bytes, "
          "little-endian) for a Python thread to answer with send(COLLECTIVES, seq, json). The "
          "Endpoint owns write_fd from now on; until this is called they are answered empty.")
      .def("enable_abort", &ddip::Endpoint::enable_abort, "signum"_a,
           "Heal's abort requests raise signum in this process; its handler, installed first, is "
           "kept as enable_stack_dumps' is.");
}
