// Who am I: rank, world size, local rank and the rendezvous address, read from the environment that a
// launcher (torchrun, Slurm's srun, Open MPI's mpirun, or `nibble train --nproc-per-node`) sets up.
// docs/DISTRIBUTED.md lists the variables per launcher and the precedence.
#pragma once
#include <functional>
#include <string>
#include "core/status.h"

namespace nb::dist {

struct World {
  int rank = 0, size = 1, local_rank = 0, local_size = 1;
  std::string master_addr = "127.0.0.1";
  int store_port = 0;             // the TCP store's port: NIBBLE_STORE_PORT, else MASTER_PORT + 1, else 29501
  std::string launcher = "none";  // "torchrun", "slurm", "mpirun", "none"
  bool distributed() const { return size > 1; }
};

// The store port when neither NIBBLE_STORE_PORT nor MASTER_PORT is set (torchrun's default MASTER_PORT
// is 29500, whose store we must not collide with).
inline constexpr int kDefaultStorePort = 29501;

// Reads the real environment (std::getenv).
Status detect_world(World* out);
// Same, with the environment given as a lookup (nullptr = unset); variables set to "" count as unset.
// Every error is one sentence naming the variable, its value and what to do.
Status detect_world_from(const std::function<const char*(const char*)>& getenv_fn, World* out);

}  // namespace nb::dist
