// `nibble train --nproc-per-node N`: the parent process starts its N local ranks itself, the way
// torchrun's standalone mode does, and supervises them (one failure stops the others).
#pragma once
#include <chrono>
#include <string>
#include <vector>
#include "core/status.h"

namespace nb::dist {

// Runs `argv` (argv[0] = the executable path) as n local ranks with RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE = n, MASTER_ADDR=127.0.0.1, MASTER_PORT (a free port found by binding port 0, unless
// MASTER_PORT is already set) and NIBBLE_STORE_PORT=MASTER_PORT+1 (a free one too; kept if already set)
// in each child's environment. Waits for all.
// If a rank exits non-zero or is killed, the others get SIGTERM, then SIGKILL after `grace`, and the
// Status names the first rank that failed and how ("rank 1 exited with code 3", "rank 0 was killed by
// signal 9"); *exit_code is then that rank's code (128 + signal when killed), else 0.
// SIGINT/SIGTERM sent to the parent are forwarded to the children (without starting the SIGKILL clock:
// a trainer answers SIGTERM by saving a checkpoint, which takes as long as it takes). Call it from the
// main thread: on Linux the children get SIGTERM when the thread that forked them ends.
Status spawn_local_ranks(int n, const std::vector<std::string>& argv, std::chrono::milliseconds grace, int* exit_code);

// A port P such that P and P + 1 are both free on all interfaces right now (for MASTER_PORT and the store).
Status find_free_port_pair(int* port);

}  // namespace nb::dist
