// Launcher detection: torchrun, then Open MPI, then Slurm, then a single process. Every variable is
// parsed completely and checked against the others, because a typo here otherwise shows up much later
// as a hang in the rendezvous.
#include "distributed/world.h"
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdlib>

namespace nb::dist {

namespace {

using Env = std::function<const char*(const char*)>;

// The value of `name`, or nullptr when unset or empty ("export VAR=" is how people clear a variable).
const char* lookup(const Env& env, const char* name) {
  const char* v = env(name);
  return (v && *v) ? v : nullptr;
}

bool parse_int(const char* s, int* out) {
  // strtol alone would accept " 3" and "+3"; a launcher never writes those, so they are typos.
  if (!std::isdigit(static_cast<unsigned char>(s[0])) && !(s[0] == '-' && std::isdigit((unsigned char)s[1])))
    return false;
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(s, &end, 10);
  if (*end != '\0' || errno == ERANGE || v < INT_MIN || v > INT_MAX) return false;
  *out = int(v);
  return true;
}

// Reads the integer variable `name`; *found says whether it was set.
Status read_int(const Env& env, const char* name, int* out, bool* found) {
  const char* v = lookup(env, name);
  *found = v != nullptr;
  if (!v) return Status::ok();
  if (!parse_int(v, out)) return errorf("%s='%s' is not an integer: set it to a whole number or unset it", name, v);
  return Status::ok();
}

Status read_required(const Env& env, const char* name, int* out) {
  bool found = false;
  NB_TRY(read_int(env, name, out, &found));
  if (!found)
    return errorf("%s is not set although the launcher set the rank and size: start every task through it", name);
  return Status::ok();
}

Status read_port(const Env& env, const char* name, int* port, bool* found) {
  NB_TRY(read_int(env, name, port, found));
  if (*found && (*port < 1 || *port > 65535))
    return errorf("%s=%d is not a TCP port (1..65535): set it to a free port", name, *port);
  return Status::ok();
}

// The names one launcher uses for the four numbers.
struct Names {
  const char* launcher;
  const char* rank;
  const char* size;
  const char* local_rank;
  const char* local_size;
};
constexpr Names kTorchrun{"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
constexpr Names kSlurm{"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"};
constexpr Names kMpirun{"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                        "OMPI_COMM_WORLD_LOCAL_SIZE"};

// torchrun and mpirun always set the local pair; a hand-made launch that sets only the global pair is
// taken to be one node (local = global).
Status read_global_local(const Env& env, const Names& n, World* w) {
  NB_TRY(read_required(env, n.rank, &w->rank));
  NB_TRY(read_required(env, n.size, &w->size));
  bool found = false;
  NB_TRY(read_int(env, n.local_rank, &w->local_rank, &found));
  if (!found) w->local_rank = w->rank;
  NB_TRY(read_int(env, n.local_size, &w->local_size, &found));
  if (!found) w->local_size = w->size;
  return Status::ok();
}

// SLURM_TASKS_PER_NODE looks like "4(x2),3": the task count of each node, runs compressed.
bool tasks_on_node(const char* spec, int node, int* count) {
  const char* p = spec;
  while (*p) {
    char* end = nullptr;
    const long c = std::strtol(p, &end, 10);
    if (end == p || c < 1) return false;
    long repeat = 1;
    if (end[0] == '(' && end[1] == 'x') {
      const char* r = end + 2;
      repeat = std::strtol(r, &end, 10);
      if (end == r || *end != ')' || repeat < 1) return false;
      ++end;
    }
    if (node < repeat) return *count = int(c), true;
    node -= int(repeat);
    if (*end != ',' && *end != '\0') return false;
    p = *end ? end + 1 : end;
  }
  return false;
}

// Slurm's local size: SLURM_NTASKS_PER_NODE (set only with --ntasks-per-node), else this node's entry
// of SLURM_TASKS_PER_NODE, else an even split over SLURM_NNODES.
Status read_slurm_local_size(const Env& env, int nnodes, World* w) {
  bool found = false;
  NB_TRY(read_int(env, "SLURM_NTASKS_PER_NODE", &w->local_size, &found));
  if (found) return Status::ok();
  const char* spec = lookup(env, "SLURM_TASKS_PER_NODE");
  int node = 0;
  NB_TRY(read_int(env, "SLURM_NODEID", &node, &found));
  if (spec && found) {
    if (tasks_on_node(spec, node, &w->local_size)) return Status::ok();
    return errorf("SLURM_TASKS_PER_NODE='%s' has no entry for SLURM_NODEID=%d: set SLURM_NTASKS_PER_NODE", spec, node);
  }
  if (w->size % nnodes != 0)
    return errorf("SLURM_NTASKS=%d does not split evenly over SLURM_NNODES=%d: launch with --ntasks-per-node", w->size,
                  nnodes);
  w->local_size = w->size / nnodes;
  return Status::ok();
}

Status read_slurm(const Env& env, World* w) {
  NB_TRY(read_required(env, "SLURM_PROCID", &w->rank));
  NB_TRY(read_required(env, "SLURM_NTASKS", &w->size));
  NB_TRY(read_required(env, "SLURM_LOCALID", &w->local_rank));
  bool found = false;
  int nnodes = 1;
  NB_TRY(read_int(env, "SLURM_NNODES", &nnodes, &found));
  if (found && nnodes < 1) return errorf("SLURM_NNODES=%d must be at least 1: launch the job through srun", nnodes);
  NB_TRY(read_slurm_local_size(env, nnodes, w));
  if (nnodes > 1 && !lookup(env, "MASTER_ADDR"))
    return errorf(
        "this is a multi-node job (SLURM_NNODES=%d) and MASTER_ADDR is not set: export MASTER_ADDR=$(scontrol show "
        "hostnames \"$SLURM_JOB_NODELIST\" | head -n 1) before srun",
        nnodes);
  return Status::ok();
}

Status check_ranks(const Names& n, const World& w) {
  if (w.size < 1) return errorf("%s=%d must be at least 1: check the launcher's command line", n.size, w.size);
  if (w.rank < 0 || w.rank >= w.size)
    return errorf("%s=%d is outside 0..%d (%s=%d): give each process a distinct rank below the world size", n.rank,
                  w.rank, w.size - 1, n.size, w.size);
  if (w.local_size < 1 || w.local_size > w.size)
    return errorf("%s=%d is outside 1..%d (%s=%d): check the launcher's tasks per node", n.local_size, w.local_size,
                  w.size, n.size, w.size);
  if (w.local_rank < 0 || w.local_rank >= w.local_size)
    return errorf("%s=%d is outside 0..%d (%s=%d): give each process on a node a distinct local rank", n.local_rank,
                  w.local_rank, w.local_size - 1, n.local_size, w.local_size);
  return Status::ok();
}

// NIBBLE_STORE_PORT, else MASTER_PORT + 1 (torchrun's own store already listens on MASTER_PORT), else 29501.
Status read_store_port(const Env& env, World* w) {
  int master = 0, store = 0;
  bool has_master = false, has_store = false;
  NB_TRY(read_port(env, "MASTER_PORT", &master, &has_master));
  NB_TRY(read_port(env, "NIBBLE_STORE_PORT", &store, &has_store));
  if (has_store) {
    w->store_port = store;
  } else if (has_master) {
    if (master == 65535)
      return errorf("MASTER_PORT=%d leaves no port above it for the rendezvous store: set NIBBLE_STORE_PORT", master);
    w->store_port = master + 1;
  } else {
    w->store_port = kDefaultStorePort;
  }
  return Status::ok();
}

Status read_launcher(const Env& env, World* w, const Names** names) {
  int slurm_tasks = 0;
  bool found = false;
  if (lookup(env, "RANK") && lookup(env, "WORLD_SIZE")) {
    *names = &kTorchrun;
    return read_global_local(env, kTorchrun, w);
  }
  // Open MPI before Slurm: mpirun inside an `sbatch --ntasks=N` allocation leaves the batch shell's
  // SLURM_PROCID=0 and SLURM_NTASKS=N in every MPI rank's environment, while OMPI_* is per process.
  if (lookup(env, "OMPI_COMM_WORLD_RANK") && lookup(env, "OMPI_COMM_WORLD_SIZE")) {
    *names = &kMpirun;
    return read_global_local(env, kMpirun, w);
  }
  // One Slurm task (a plain sbatch shell) is not a distributed job.
  if (lookup(env, "SLURM_PROCID") && lookup(env, "SLURM_NTASKS")) {
    NB_TRY(read_int(env, "SLURM_NTASKS", &slurm_tasks, &found));
    if (slurm_tasks > 1) {
      *names = &kSlurm;
      return read_slurm(env, w);
    }
  }
  *names = nullptr;
  return Status::ok();
}

}  // namespace

Status detect_world_from(const std::function<const char*(const char*)>& getenv_fn, World* out) {
  World w;
  const Names* names = nullptr;
  NB_TRY(read_launcher(getenv_fn, &w, &names));
  if (names) {
    w.launcher = names->launcher;
    // `nibble train --nproc-per-node` sets torchrun's variables and says so.
    if (names == &kTorchrun && lookup(getenv_fn, "NIBBLE_LAUNCHER")) w.launcher = "nibble --nproc-per-node";
    NB_TRY(check_ranks(*names, w));
  }
  NB_TRY(read_store_port(getenv_fn, &w));
  if (const char* addr = lookup(getenv_fn, "MASTER_ADDR")) {
    w.master_addr = addr;
  } else if (w.local_size < w.size) {
    // 127.0.0.1 only reaches rank 0 from its own node.
    return errorf(
        "ranks span several nodes (%s=%d, %s=%d) and MASTER_ADDR is not set: export MASTER_ADDR as the first node's "
        "host name on every node",
        names->local_size, w.local_size, names->size, w.size);
  }
  *out = w;
  return Status::ok();
}

Status detect_world(World* out) {
  return detect_world_from([](const char* name) { return static_cast<const char*>(std::getenv(name)); }, out);
}

}  // namespace nb::dist
