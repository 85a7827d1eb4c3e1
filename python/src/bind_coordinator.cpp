#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "ddip/coordinator.hpp"
#include "slices.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using WorkerSpec = std::tuple<std::vector<std::string>, std::vector<std::string>, std::string>;
// (name, launcher argv, launcher env, slots that run there)
using HostSpec =
    std::tuple<std::string, std::vector<std::string>, std::vector<std::string>, std::vector<int>>;

nb::bytes to_bytes(const std::string& s) { return nb::bytes(s.data(), s.size()); }

std::string from_bytes(const nb::bytes& b) { return std::string(b.c_str(), b.size()); }

// (kind, slot, a, b, data, fds): Output (0, slot, stream, 0, text); Frame (1, slot, frame kind,
// seq, payload, the fds that came with it: Python's to close); Exited (2, slot, exit code,
// signal, stderr tail; exit code -1 with signal 0: the status is unknown, someone else in this
// process reaped it); Disconnected (3, slot, 0, 0, b""); Failed (4, -1, 0, 0, message);
// Unresponsive (5, slot, ms since its last heartbeat answer, 0, b""); Responsive (6, slot, 0, 0,
// b""); Truncated (7, slot, frame kind, seq, payload, the fds that did arrive): a frame that
// lost fds on the way in, this process being out of them; Lost (8, slot, 0, 0, why): a worker
// on another host, gone with its host's link or launcher.
nb::object event_tuple(ddip::Event& e) {
  nb::list fds;
  auto take_fds = [&] {
    if (e.frame.fds)
      for (auto& fd : *e.frame.fds) fds.append(fd.release());
  };
  switch (e.kind) {
    case ddip::Event::kOutput:
      return nb::make_tuple(0, e.slot, e.stream, 0, to_bytes(e.text), fds);
    case ddip::Event::kFrame:
      take_fds();
      return nb::make_tuple(1, e.slot, static_cast<int>(e.frame.kind), e.frame.seq,
                            to_bytes(e.frame.data()), fds);
    case ddip::Event::kExited:
      if (e.status.unknown) return nb::make_tuple(2, e.slot, -1, 0, to_bytes(e.text), fds);
      return nb::make_tuple(2, e.slot, e.status.code, e.status.signal, to_bytes(e.text), fds);
    case ddip::Event::kDisconnected:
      return nb::make_tuple(3, e.slot, 0, 0, nb::bytes("", 0), fds);
    case ddip::Event::kFailed:
      return nb::make_tuple(4, -1, 0, 0, to_bytes(e.text), fds);
    case ddip::Event::kUnresponsive:
      return nb::make_tuple(5, e.slot, e.age_ms, 0, nb::bytes("", 0), fds);
    case ddip::Event::kResponsive:
      return nb::make_tuple(6, e.slot, 0, 0, nb::bytes("", 0), fds);
    case ddip::Event::kTruncated:
      take_fds();
      return nb::make_tuple(7, e.slot, static_cast<int>(e.frame.kind), e.frame.seq,
                            to_bytes(e.frame.data()), fds);
    case ddip::Event::kLost:
      return nb::make_tuple(8, e.slot, 0, 0, to_bytes(e.text), fds);
  }
  return nb::none();
}

}  // namespace

void init_coordinator(nb::module_& m) {
  nb::class_<ddip::Coordinator>(m, "Coordinator",
                                "Kernel side of a group: spawns workers, owns every fd on one "
                                "IO thread, reports output, frames and exits as events.")
      .def(
          "__init__",
          [](ddip::Coordinator* self, const std::vector<WorkerSpec>& workers, int heartbeat_ms,
             int partial_line_ms, int heartbeat_timeout_ms, int pool_idle_ms,
             ddip::RankTemplate* rank_template, const std::vector<HostSpec>& hosts,
             const std::string& bind_address, int bind_port) {
            ddip::CoordinatorOptions o;
            for (const auto& [argv, env, cwd] : workers) {
              ddip::SpawnSpec s;
              s.argv = argv;
              s.env = env;
              s.cwd = cwd;
              o.workers.push_back(std::move(s));
            }
            o.heartbeat_interval = std::chrono::milliseconds(heartbeat_ms);
            o.partial_line_delay = std::chrono::milliseconds(partial_line_ms);
            o.rank_template = rank_template;  // used only while starting, inside this call
            o.heartbeat_timeout = std::chrono::milliseconds(heartbeat_timeout_ms);
            o.pool_idle = std::chrono::milliseconds(pool_idle_ms);
            for (const auto& [name, argv, env, slots] : hosts) {
              ddip::RemoteHost h;
              h.name = name;
              h.launcher.argv = argv;
              h.launcher.env = env;
              h.slots = slots;
              o.hosts.push_back(std::move(h));
            }
            o.bind_address = bind_address;
            if (bind_port < 0 || bind_port > 65535)
              throw std::invalid_argument("bind_port must be 0..65535");
            o.bind_port = static_cast<uint16_t>(bind_port);
            nb::gil_scoped_release release;
            new (self) ddip::Coordinator(std::move(o));
          },
          "workers"_a, "heartbeat_ms"_a = 1000, "partial_line_ms"_a = 50,
          "heartbeat_timeout_ms"_a = 10000, "pool_idle_ms"_a = 5000,
          nb::arg("rank_template").none() = nb::none(), "hosts"_a = std::vector<HostSpec>{},
          "bind_address"_a = "127.0.0.1", "bind_port"_a = 0,
          "heartbeat_timeout_ms: a worker silent this long is reported unresponsive (0: never); "
          "pool_idle_ms: pooled shared memory unused this long is freed (0: kept); rank_template: "
          "fork workers from this warm template; hosts: (name, launcher argv, launcher env, "
          "slots) for workers on other hosts, whose agents connect back to bind_address:bind_port "
          "(0: any free port) over authenticated TCP.")
      .def_prop_ro("pids",
                   [](const ddip::Coordinator& c) {
                     return std::vector<int>(c.pids().begin(), c.pids().end());
                   })
      .def_prop_ro("socket_path", &ddip::Coordinator::socket_path)
      .def_prop_ro("link_address", &ddip::Coordinator::link_address)
      .def_prop_ro("rejected_connections", &ddip::Coordinator::rejected_connections)
      .def_prop_ro("last_rejection", &ddip::Coordinator::last_rejection)
      .def_prop_ro("running", &ddip::Coordinator::running)
      .def(
          "send",
          [](ddip::Coordinator& c, const std::vector<int>& slots, int kind, uint64_t seq,
             const nb::bytes& payload, const std::vector<uint64_t>& segments) {
            // One payload shared by every slot's frame.
            auto shared = std::make_shared<const std::string>(from_bytes(payload));
            for (int slot : slots) {
              ddip::Frame f;
              f.kind = static_cast<uint16_t>(kind);
              f.rank = slot;
              f.seq = seq;
              f.payload = shared;
              c.send(slot, std::move(f), segments);
            }
          },
          "slots"_a, "kind"_a, "seq"_a, "payload"_a, "segments"_a = std::vector<uint64_t>{})
      .def(
          "put",
          [](ddip::Coordinator& c, nb::handle obj) {
            // Any C-contiguous buffer (a PickleBuffer's raw view): copied once, GIL released.
            struct View {
              Py_buffer b{};
              ~View() { PyBuffer_Release(&b); }  // also when put() throws
            } view;
            if (PyObject_GetBuffer(obj.ptr(), &view.b, PyBUF_C_CONTIGUOUS) != 0)
              throw nb::python_error();
            nb::gil_scoped_release release;
            return c.pool().put(view.b.buf, static_cast<size_t>(view.b.len));
          },
          "buffer"_a,
          "Copies a buffer into a shared-memory segment; returns its id (one reference).")
      .def(
          "release", [](ddip::Coordinator& c, uint64_t id) { c.pool().release(id); }, "segment"_a)
      .def("pool_stats",
           [](ddip::Coordinator& c) {
             return nb::make_tuple(c.pool().in_use(), c.pool().free_bytes(), c.pool().created());
           })
      .def("signal", &ddip::Coordinator::signal, "slot"_a, "sig"_a, "whole_group"_a = false)
      .def(
          "next_event",
          [](ddip::Coordinator& c, double timeout_ms) -> nb::object {
            auto e = ddip_python::wait_in_slices<ddip::Event>(
                timeout_ms, [&](std::chrono::milliseconds slice) { return c.next_event(slice); });
            if (!e) return nb::none();
            return event_tuple(*e);
          },
          "timeout_ms"_a)
      .def("heartbeat_age_ms", &ddip::Coordinator::heartbeat_age_ms, "slot"_a)
      .def("connected", &ddip::Coordinator::connected, "slot"_a)
      .def(
          "trim_pool",
          [](ddip::Coordinator& c) {
            nb::gil_scoped_release release;
            return c.pool().trim(std::chrono::steady_clock::duration::zero());
          },
          "Frees every unused pooled shared-memory segment now; returns the bytes freed.")
      .def(
          "close",
          [](ddip::Coordinator& c, int grace_ms) {
            // Waits in slices, so Ctrl-C interrupts the wait; the IO thread goes on stopping the
            // workers, and the object's destructor joins it.
            c.begin_close(std::chrono::milliseconds(grace_ms));
            ddip_python::wait_in_slices<std::vector<pid_t>>(
                -1, [&](std::chrono::milliseconds slice) { return c.wait_closed(slice); });
            nb::gil_scoped_release release;
            auto stuck = c.close(std::chrono::milliseconds(grace_ms));
            return std::vector<int>(stuck.begin(), stuck.end());
          },
          "grace_ms"_a = 2000,
          "Stops every worker (shutdown, SIGTERM after grace_ms, SIGKILL after grace_ms more); "
          "returns the pids that could not be reaped within 5 s of SIGKILL.");
}
