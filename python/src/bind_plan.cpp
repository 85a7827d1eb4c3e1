// ddip._core.plan: the launch plan (cpp/ddip/plan.hpp), the one copy Python uses too.
// std::invalid_argument arrives in Python as ValueError, with the plan's own message.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "ddip/plan.hpp"

namespace nb = nanobind;
using namespace nb::literals;
namespace plan = ddip::plan;

void init_plan(nb::module_& parent) {
  nb::module_ m = parent.def_submodule("plan", "The launch plan: hosts, GPUs, rank environments, launchers");
  m.attr("MAX_RANKS_PER_HOST") = plan::kMaxRanksPerHost;

  nb::class_<plan::Host>(m, "Host")
      .def(nb::init<>())
      .def_rw("name", &plan::Host::name)
      .def_rw("ranks", &plan::Host::ranks)
      .def_rw("gpus", &plan::Host::gpus)
      .def_rw("local", &plan::Host::local)
      .def("__repr__", [](const plan::Host& h) {
        std::string g;
        for (const auto& x : h.gpus) g += (g.empty() ? "" : ",") + x;
        return "Host(" + h.name + ", ranks=" + std::to_string(h.ranks) +
               (g.empty() ? "" : ", gpus=[" + g + "]") + (h.local ? ", local" : "") + ")";
      });
  m.def("is_this_host", &plan::is_this_host, "name"_a);
  m.def("parse_hosts", [](const std::string& text) { return plan::parse_hosts(text); }, "text"_a,
        "'node1:4,node2:4' or 'node1[0,1] node2[2,3]' -> [Host], in rank order.");
  m.def("hosts_with_gpus", &plan::hosts_with_gpus, "hosts"_a.none(), "gpus"_a);

  m.def("nvidia_device_count", &plan::nvidia_device_count);
  m.def("visible_gpus", &plan::visible_gpus, "env"_a.none(), "physical_count"_a);
  m.def(
      "select_gpus",
      [](const std::vector<std::string>& requested, std::optional<std::string> env,
         int physical_count, std::vector<std::string> uuids, std::string who,
         std::string cpu_hint) {
        plan::GpuView view{std::move(env), physical_count, std::move(uuids), std::move(who),
                           std::move(cpu_hint)};
        std::vector<std::pair<std::string, std::optional<int>>> out;
        for (auto& g : plan::select_gpus(requested, view)) out.emplace_back(g.entry, g.position);
        return out;
      },
      "requested"_a, "env"_a.none(), "physical_count"_a, "uuids"_a = std::vector<std::string>{},
      "who"_a = "this process", "cpu_hint"_a = "",
      "GPU requests -> [(CUDA_VISIBLE_DEVICES entry, position in the visible list or None)].");

  m.def("source_address", &plan::source_address, "host"_a);
  m.def("free_port", &plan::free_port, "address"_a = "127.0.0.1");
  nb::class_<plan::Layout>(m, "Layout")
      .def_ro("hosts", &plan::Layout::hosts)
      .def_ro("slot_host", &plan::Layout::slot_host)
      .def_ro("local_rank", &plan::Layout::local_rank)
      .def_ro("first_rank", &plan::Layout::first_rank)
      .def_ro("master_addr", &plan::Layout::master_addr)
      .def_ro("bind", &plan::Layout::bind)
      .def_prop_ro("size", &plan::Layout::size);
  m.def("lay_out", &plan::lay_out, "hosts"_a, "master_addr"_a = "", "bind"_a = "",
        "need_bind"_a = true);
  m.def("master_port", &plan::master_port, "rank0_here"_a, "address"_a = "0.0.0.0");

  m.def("cpu_count", &plan::cpu_count);
  m.def("omp_threads", &plan::omp_threads, "cores"_a, "local_ranks"_a);
  m.def(
      "rank_environment",
      [](const std::vector<std::string>& base, int local_rank, int world_size,
         int local_world_size, int rank_offset, int group_rank, int group_world_size,
         std::string master_addr, int master_port, std::optional<std::string> cuda_visible_devices,
         bool cpu_ranks, int cores) {
        plan::LaunchEnv l;
        l.world_size = world_size;
        l.local_world_size = local_world_size;
        l.rank_offset = rank_offset;
        l.group_rank = group_rank;
        l.group_world_size = group_world_size;
        l.master_addr = std::move(master_addr);
        l.master_port = master_port;
        l.cuda_visible_devices = std::move(cuda_visible_devices);
        l.cpu_ranks = cpu_ranks;
        l.cores = cores;
        return plan::rank_environment(base, l, local_rank);
      },
      "base"_a, "local_rank"_a, nb::kw_only(), "world_size"_a, "local_world_size"_a = 0,
      "rank_offset"_a = 0, "group_rank"_a = 0, "group_world_size"_a = 1,
      "master_addr"_a = "127.0.0.1", "master_port"_a, "cuda_visible_devices"_a.none() = nb::none(),
      "cpu_ranks"_a = false, "cores"_a = 0,
      "torchrun's environment for one rank on top of base ['KEY=value', ...] (see plan.hpp).");

  m.def("uniform_cpus", &plan::uniform_cpus, "cpus_per_node"_a);
  m.def("shell_quote", &plan::shell_quote, "word"_a);
  m.def("split_words", &plan::split_words, "text"_a);
  m.def("launcher_argv", &plan::launcher_argv, "launcher"_a, "host"_a, "command"_a,
        "slurm_cpus"_a = "", "link_timeout_s"_a = 30.0);
}
