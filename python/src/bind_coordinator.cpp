#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>

#include "ddip/coordinator.hpp"
#include "ddip/keeper.hpp"
#include "ddip/link_protocol.hpp"
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

// An event as Python sees it: a named object whose kind is classified here, once. Kinds:
//   "output"        stream ("stdout" / "stderr"), data: the text
//   "hello"         data: the worker's hello payload
//   "done"          seq, data, fds (Python's to close): a reply; slots: every worker that sent
//                   it byte for byte when a host's agent gathered it (slot is the first), else ()
//   "truncated"     seq: a reply whose fds could not all be received (this process is out of them)
//   "display", "message", "stacks", "collectives"   seq, data
//   "exited"        code, signal, why ("exit code 3", "killed by SIGKILL": the runtime's words),
//                   data: the last lines of its stderr (code -1 with signal 0: the status is
//                   unknown, someone else in this process reaped it)
//   "lost"          data: why (a worker on another host, gone with its host's link or launcher)
//   "unresponsive"  age: seconds since its last heartbeat answer; "responsive"; "disconnected"
//   "failed"        slot -1, data: the runtime's error
// Other frames (and displays or messages that lost fds) are not the notebook's: never surfaced.
struct PyEvent {
  nb::object kind;
  int slot = -1;
  uint64_t seq = 0;
  nb::object stream = nb::none();
  nb::object data = nb::bytes("", 0);
  nb::object fds = nb::tuple();  // the empty tuple is shared
  nb::object slots = nb::tuple();
  int code = 0;
  int signal = 0;
  nb::object why = nb::none();
  double age = 0;
};

struct Kinds {
  nb::object output, hello, done, truncated, display, message, stacks, collectives, exited, lost,
      unresponsive, responsive, disconnected, failed, stdout_, stderr_;
  Kinds() {
    auto s = [](const char* name) {
      PyObject* o = PyUnicode_InternFromString(name);
      if (!o) throw nb::python_error();
      return nb::steal(o);
    };
    output = s("output"), hello = s("hello"), done = s("done"), truncated = s("truncated");
    display = s("display"), message = s("message"), stacks = s("stacks"), exited = s("exited");
    collectives = s("collectives");
    lost = s("lost"), unresponsive = s("unresponsive"), responsive = s("responsive");
    disconnected = s("disconnected"), failed = s("failed");
    stdout_ = s("stdout"), stderr_ = s("stderr");
  }
};

const Kinds& kinds() {
  static const Kinds* k = new Kinds();  // never freed: Python objects outliving the interpreter
  return *k;
}

// The Python event for `e`; nullopt for what is not the notebook's.
std::optional<PyEvent> classify(ddip::Event& e) {
  const Kinds& k = kinds();
  PyEvent p;
  p.slot = e.slot;
  switch (e.kind) {
    case ddip::Event::kOutput:
      p.kind = k.output;
      p.stream = e.stream == 2 ? k.stderr_ : k.stdout_;
      p.data = to_bytes(e.text);
      return p;
    case ddip::Event::kFrame:
    case ddip::Event::kTruncated: {
      bool truncated = e.kind == ddip::Event::kTruncated;
      p.seq = e.frame.seq;
      switch (e.frame.kind) {
        case ddip::kDone:
          p.kind = truncated ? k.truncated : k.done;
          if (truncated) return p;  // its fds that did arrive are closed with the frame
          break;
        case ddip::kHello:
          p.kind = k.hello;
          break;
        case ddip::kDisplay:
          p.kind = k.display;
          break;
        case ddip::kMessage:
          p.kind = k.message;
          break;
        case ddip::kStacks:
          p.kind = k.stacks;
          break;
        case ddip::kCollectives:
          p.kind = k.collectives;
          break;
        default:
          return std::nullopt;
      }
      if (truncated) return std::nullopt;  // a display or message whose buffers were lost
      p.data = to_bytes(e.frame.data());
      if (!e.slots.empty()) p.slots = nb::tuple(nb::cast(e.slots));
      if (e.frame.kind == ddip::kDone && e.frame.fds) {
        nb::list fds;
        for (auto& fd : *e.frame.fds) fds.append(fd.release());
        p.fds = fds;
      }
      return p;
    }
    case ddip::Event::kExited:
      p.kind = k.exited;
      p.code = e.status.unknown ? -1 : e.status.code;
      p.signal = e.status.unknown ? 0 : e.status.signal;
      p.why = nb::str(e.status.describe().c_str());
      p.data = to_bytes(e.text);
      return p;
    case ddip::Event::kDisconnected:
      p.kind = k.disconnected;
      return p;
    case ddip::Event::kFailed:
      p.kind = k.failed;
      p.slot = -1;
      p.data = to_bytes(e.text);
      return p;
    case ddip::Event::kUnresponsive:
      p.kind = k.unresponsive;
      p.age = static_cast<double>(e.age_ms) / 1000.0;
      return p;
    case ddip::Event::kResponsive:
      p.kind = k.responsive;
      return p;
    case ddip::Event::kLost:
      p.kind = k.lost;
      p.data = to_bytes(e.text);
      return p;
  }
  return std::nullopt;
}

}  // namespace

void init_coordinator(nb::module_& m) {
  m.attr("REPLY_WINDOW_MS") = ddip::ReplyGather::kWindow.count();
  nb::class_<PyEvent>(
      m, "Event",
      "What a group's runtime reports: kind (output, hello, done, truncated, "
      "display, message, stacks, collectives, exited, lost, unresponsive, "
      "responsive, disconnected, failed), the worker's slot, and the fields of that kind.")
      .def_ro("kind", &PyEvent::kind)
      .def_ro("slot", &PyEvent::slot)
      .def_ro("seq", &PyEvent::seq)
      .def_ro("stream", &PyEvent::stream)
      .def_ro("data", &PyEvent::data)
      .def_ro("fds", &PyEvent::fds)
      .def_ro("slots", &PyEvent::slots)
      .def_ro("code", &PyEvent::code)
      .def_ro("signal", &PyEvent::signal)
      .def_ro("why", &PyEvent::why)
      .def_ro("age", &PyEvent::age)
      .def("__repr__", [](const PyEvent& e) {
        return nb::str("<Event {} slot={} seq={} {!r}>").format(e.kind, e.slot, e.seq, e.data);
      });
  nb::class_<ddip::Coordinator>(m, "Coordinator",
                                "Kernel side of a group: spawns workers, owns every fd on one "
                                "IO thread, reports output, frames and exits as events.")
      .def(
          "__init__",
          [](ddip::Coordinator* self, const std::vector<WorkerSpec>& workers, int heartbeat_ms,
             int partial_line_ms, int heartbeat_timeout_ms, int pool_idle_ms,
             ddip::RankTemplate* rank_template, const std::vector<HostSpec>& hosts,
             const std::string& bind_address, int bind_port, ddip::AgentKeeper* agent_keeper,
             int remote_warm, int reply_window_ms) {
            ddip::CoordinatorOptions o;
            o.caller_drives = true;  // the kernel waits for its replies on its main thread
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
            if (remote_warm < 0 || remote_warm > 2)
              throw std::invalid_argument(
                  "remote_warm must be 0 (cold), 1 (when ready) or 2 (wait)");
            o.agent_keeper = agent_keeper;  // kept alive by this object (keep_alive below)
            o.remote_warm = static_cast<uint32_t>(remote_warm);
            if (reply_window_ms < 0) throw std::invalid_argument("reply_window_ms must be >= 0");
            o.reply_window = std::chrono::milliseconds(reply_window_ms);
            nb::gil_scoped_release release;
            new (self) ddip::Coordinator(std::move(o));
          },
          "workers"_a, "heartbeat_ms"_a = 1000, "partial_line_ms"_a = 50,
          "heartbeat_timeout_ms"_a = 10000, "pool_idle_ms"_a = 5000,
          nb::arg("rank_template").none() = nb::none(), "hosts"_a = std::vector<HostSpec>{},
          "bind_address"_a = "127.0.0.1", "bind_port"_a = 0,
          nb::arg("agent_keeper").none() = nb::none(), "remote_warm"_a = 0, "reply_window_ms"_a = 0,
          nb::keep_alive<1, 11>(),
          "heartbeat_timeout_ms: a worker silent this long is reported unresponsive (0: never); "
          "pool_idle_ms: pooled shared memory unused this long is freed (0: kept); rank_template: "
          "fork workers from this warm template; hosts: (name, launcher argv, launcher env, "
          "slots) for workers on other hosts, whose agents connect back to bind_address:bind_port "
          "(0: any free port) over authenticated TCP; agent_keeper: lease each host's launcher "
          "from "
          "these standing agents (none: one-shot); remote_warm: fork there from the host's rank "
          "template (0 no, 1 when ready, 2 waiting for it); reply_window_ms: how long a host's "
          "agent holds its ranks' replies to a request for the rest of them, to send them as one "
          "frame (0: REPLY_WINDOW_MS).")
      .def_prop_ro("pids",
                   [](const ddip::Coordinator& c) {
                     auto pids = c.pids();
                     return std::vector<int>(pids.begin(), pids.end());
                   })
      .def_prop_ro("socket_path", &ddip::Coordinator::socket_path)
      .def_prop_ro("link_address", &ddip::Coordinator::link_address)
      .def_prop_ro("rejected_connections", &ddip::Coordinator::rejected_connections)
      .def_prop_ro("last_rejection", &ddip::Coordinator::last_rejection)
      .def_prop_ro("host_reply_frames", &ddip::Coordinator::host_reply_frames,
                   "Frames that brought replies from other hosts (one per host and request where "
                   "their agents gather them).")
      .def_prop_ro("host_notes", &ddip::Coordinator::host_notes,
                   "What other hosts' agents said for the user, as (host, text) in the order it "
                   "came: why a host's ranks start cold. Complete for a host once its ranks said "
                   "hello.")
      .def_prop_ro("running", &ddip::Coordinator::running)
      .def(
          "send",
          [](ddip::Coordinator& c, const std::vector<int>& slots, int kind, uint64_t seq,
             const nb::bytes& payload, const std::vector<uint64_t>& segments) {
            // One payload shared by every slot's frame, one command to the IO thread.
            ddip::Frame f;
            f.kind = static_cast<uint16_t>(kind);
            f.seq = seq;
            f.payload = std::make_shared<const std::string>(from_bytes(payload));
            c.send(slots, std::move(f), segments);
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
      .def("catch_up_output", &ddip::Coordinator::catch_up_output, "slots"_a,
           nb::call_guard<nb::gil_scoped_release>(),
           "Reads what these workers' output pipes hold now into the event queue; returns once "
           "it did.")
      .def("signal", &ddip::Coordinator::signal, "slot"_a, "sig"_a, "whole_group"_a = false)
      .def(
          "next_event",
          [](ddip::Coordinator& c, double timeout_ms) -> nb::object {
            // Waits in slices (Ctrl-C is never blocked); what is not the notebook's is skipped.
            auto deadline =
                std::chrono::steady_clock::now() +
                std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                    std::chrono::duration<double, std::milli>(std::max(timeout_ms, 0.0)));
            while (true) {
              double left = std::chrono::duration<double, std::milli>(
                                deadline - std::chrono::steady_clock::now())
                                .count();
              auto e = ddip_python::wait_in_slices<ddip::Event>(
                  std::max(left, 0.0),
                  [&](std::chrono::milliseconds slice) { return c.next_event(slice); });
              if (!e) return nb::none();
              if (auto p = classify(*e)) return nb::cast(std::move(*p));
            }
          },
          "timeout_ms"_a, "The next Event within timeout_ms, or None.")
      .def(
          "next_events",
          [](ddip::Coordinator& c, nb::object inbox, double timeout_ms, size_t replies) {
            // Events already queued are taken without releasing the GIL (the loop never needs
            // it), unless the wait is for `replies`; a wait is in slices (Ctrl-C is never
            // blocked). They go straight into `inbox` (its append): none is ever held only
            // here, where an interrupt could lose it.
            std::vector<ddip::Event> got;
            if (replies == 0 || timeout_ms <= 0) c.take_events(got);
            if (got.empty() && timeout_ms > 0)
              ddip_python::wait_in_slices<bool>(
                  timeout_ms, [&](std::chrono::milliseconds slice) -> std::optional<bool> {
                    if (c.wait_events(got, slice, replies) > 0) return true;
                    return std::nullopt;
                  });
            nb::object append = inbox.attr("append");
            int n = 0;
            for (auto& e : got)
              if (auto p = classify(e)) {
                append(nb::cast(std::move(*p)));
                ++n;
              }
            return n;
          },
          "inbox"_a, "timeout_ms"_a, "replies"_a = 0,
          "Appends to inbox every Event queued now or, when none is, those that arrive within "
          "timeout_ms; returns how many. With replies (a request's ranks yet to reply), waits "
          "until that many replies are queued, or what is queued waited "
          "CoordinatorOptions::reply_wait (5 ms), and takes them all at once.")
      .def(
          "respawn",
          [](ddip::Coordinator& c, int slot, std::optional<WorkerSpec> spec,
             ddip::RankTemplate* rank_template) {
            std::optional<ddip::SpawnSpec> s;
            if (spec) {
              s.emplace();
              std::tie(s->argv, s->env, s->cwd) = *spec;
            }
            nb::gil_scoped_release release;
            return static_cast<int>(c.respawn(slot, std::move(s), rank_template));
          },
          "slot"_a, nb::arg("spec").none() = nb::none(),
          nb::arg("rank_template").none() = nb::none(),
          "Starts the worker of `slot` again after it exited (its state reset: connection, hello, "
          "heartbeats, segments), from `spec` (argv, env, cwd; None: its first spec), forked from "
          "rank_template when given and it can, else cold; returns the new pid. A slot on another "
          "host is started by that host's agent, from its own template (rank_template unused), "
          "and -1 is returned (the pid comes in its hello; a failure there, as its exit). "
          "IndexError for no such slot; RuntimeError for a worker still running, one whose host's "
          "link is gone, or a closing group; OSError when it can't be started.")
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
