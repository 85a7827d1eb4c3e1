#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>

#include "ddip/host_agent.hpp"

namespace nb = nanobind;
using namespace nb::literals;

void init_host_agent(nb::module_& m) {
  m.def(
      "run_host_agent",
      [](const std::string& ticket, int kernel_timeout_ms, int connect_timeout_ms) {
        ddip::AgentOptions o;
        o.ticket = ddip::LinkTicket::decode(ticket);
        o.kernel_timeout = std::chrono::milliseconds(kernel_timeout_ms);  // the ticket's wins
        o.connect_timeout = std::chrono::milliseconds(connect_timeout_ms);
        ddip::HostAgent agent(o);
        int rc;
        {
          nb::gil_scoped_release release;
          rc = agent.run();
        }
        return std::make_tuple(rc, agent.why());
      },
      "ticket"_a, "kernel_timeout_ms"_a = 10000, "connect_timeout_ms"_a = 15000,
      "Runs this host's part of a group (python -m ddip.remote): connects back to the kernel with "
      "the ticket its launcher gave on stdin, starts the workers the kernel names, relays them, "
      "and returns (exit code, why) once they are gone. Raises when it can't connect or "
      "authenticate.");
  m.def(
      "unforkable",
      [](const std::vector<std::string>& template_argv,
         const std::vector<std::string>& template_env, const std::vector<std::string>& argv,
         const std::vector<std::string>& env) {
        return ddip::unforkable(ddip::SpawnSpec{template_argv, template_env, "", true},
                                ddip::SpawnSpec{argv, env, "", true});
      },
      "template_argv"_a, "template_env"_a, "argv"_a, "env"_a,
      "Why a rank (argv, env) can't be a fork of a rank template started with (template_argv, "
      "template_env), or '' when it can.");
  m.def(
      "serve_host_agent",
      [](int input, nb::object template_spec, int kernel_timeout_ms, int connect_timeout_ms) {
        std::optional<ddip::SpawnSpec> spec;
        if (!template_spec.is_none()) {
          auto [argv, env, cwd] =
              nb::cast<std::tuple<std::vector<std::string>, std::vector<std::string>, std::string>>(
                  template_spec);
          spec = ddip::SpawnSpec{argv, env, cwd, true};
        }
        ddip::AgentOptions o;
        o.kernel_timeout = std::chrono::milliseconds(kernel_timeout_ms);  // the ticket's wins
        o.connect_timeout = std::chrono::milliseconds(connect_timeout_ms);
        ddip::HostAgent agent(o);
        int rc;
        {
          nb::gil_scoped_release release;
          rc = agent.serve(input, std::move(spec));
        }
        return std::make_tuple(rc, agent.why());
      },
      "input"_a, nb::arg("template_spec").none(), "kernel_timeout_ms"_a = 10000,
      "connect_timeout_ms"_a = 15000,
      "python -m ddip.remote: serves the tickets its launcher writes on `input` (its stdin): one "
      "group for a one-shot ticket; for a standing one, groups until end of file there, forking "
      "their workers from this host's rank template, started from template_spec ((argv, env, "
      "cwd), or None: cold ranks). Returns (exit code, why); raises when it can't connect or "
      "authenticate.");
}
