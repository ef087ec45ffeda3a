// World detection: each launcher's variables, the precedence between launchers, the store port rule,
// and the errors: each bad value gives one sentence that names its variable and value.
#include <gtest/gtest.h>
#include <map>
#include <string>
#include "distributed/world.h"

using namespace nb;
using namespace nb::dist;

namespace {

using Env = std::map<std::string, std::string>;

Status detect(const Env& env, World* w) {
  return detect_world_from(
      [&](const char* name) -> const char* {
        auto it = env.find(name);
        return it == env.end() ? nullptr : it->second.c_str();
      },
      w);
}

World detected(const Env& env) {
  World w;
  const Status s = detect(env, &w);
  EXPECT_TRUE(s) << s.message();
  return w;
}

std::string error_of(const Env& env) {
  World w;
  const Status s = detect(env, &w);
  EXPECT_FALSE(s) << "expected an error";
  return s.message();
}

const Env kTorchrun = {{"RANK", "5"},
                       {"WORLD_SIZE", "8"},
                       {"LOCAL_RANK", "1"},
                       {"LOCAL_WORLD_SIZE", "4"},
                       {"MASTER_ADDR", "node0"},
                       {"MASTER_PORT", "29500"}};
const Env kSlurm = {{"SLURM_PROCID", "3"},          {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"},
                    {"SLURM_NTASKS_PER_NODE", "2"}, {"SLURM_NNODES", "2"}, {"MASTER_ADDR", "gpu-01"}};
const Env kMpirun = {{"OMPI_COMM_WORLD_RANK", "2"},
                     {"OMPI_COMM_WORLD_SIZE", "3"},
                     {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                     {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"}};

Env merged(Env a, const Env& b) {
  for (const auto& [k, v] : b) a[k] = v;
  return a;
}

}  // namespace

TEST(World, SingleProcessByDefault) {
  const World w = detected({});
  EXPECT_EQ(w.launcher, "none");
  EXPECT_EQ(w.rank, 0);
  EXPECT_EQ(w.size, 1);
  EXPECT_EQ(w.local_rank, 0);
  EXPECT_EQ(w.local_size, 1);
  EXPECT_EQ(w.master_addr, "127.0.0.1");
  EXPECT_EQ(w.store_port, 29501);
  EXPECT_FALSE(w.distributed());
}

TEST(World, Torchrun) {
  const World w = detected(kTorchrun);
  EXPECT_EQ(w.launcher, "torchrun");
  EXPECT_EQ(w.rank, 5);
  EXPECT_EQ(w.size, 8);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_size, 4);
  EXPECT_EQ(w.master_addr, "node0");
  EXPECT_EQ(w.store_port, 29501);
  EXPECT_TRUE(w.distributed());
  // A hand-made launch with only the global pair is one node.
  const World one = detected({{"RANK", "2"}, {"WORLD_SIZE", "4"}});
  EXPECT_EQ(one.local_rank, 2);
  EXPECT_EQ(one.local_size, 4);
  EXPECT_EQ(one.master_addr, "127.0.0.1");
}

TEST(World, Slurm) {
  const World w = detected(kSlurm);
  EXPECT_EQ(w.launcher, "slurm");
  EXPECT_EQ(w.rank, 3);
  EXPECT_EQ(w.size, 4);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_size, 2);
  EXPECT_EQ(w.master_addr, "gpu-01");
  // Without --ntasks-per-node: this node's entry of SLURM_TASKS_PER_NODE, else an even split.
  const Env uneven = {{"SLURM_PROCID", "9"},
                      {"SLURM_NTASKS", "11"},
                      {"SLURM_LOCALID", "1"},
                      {"SLURM_NNODES", "3"},
                      {"SLURM_TASKS_PER_NODE", "4(x2),3"},
                      {"SLURM_NODEID", "2"},
                      {"MASTER_ADDR", "a"}};
  EXPECT_EQ(detected(uneven).local_size, 3);
  EXPECT_EQ(detected(merged(uneven, {{"SLURM_NODEID", "1"}, {"SLURM_PROCID", "5"}})).local_size, 4);
  const Env even = {{"SLURM_PROCID", "5"},
                    {"SLURM_NTASKS", "8"},
                    {"SLURM_LOCALID", "1"},
                    {"SLURM_NNODES", "2"},
                    {"MASTER_ADDR", "a"}};
  EXPECT_EQ(detected(even).local_size, 4);
  // One node needs no MASTER_ADDR.
  const World single = detected({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"}});
  EXPECT_EQ(single.local_size, 2);
  EXPECT_EQ(single.master_addr, "127.0.0.1");
}

TEST(World, OneSlurmTaskIsNotDistributed) {
  const World w = detected({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_LOCALID", "0"}});
  EXPECT_EQ(w.launcher, "none");
  EXPECT_FALSE(w.distributed());
}

TEST(World, OpenMpi) {
  const World w = detected(kMpirun);
  EXPECT_EQ(w.launcher, "mpirun");
  EXPECT_EQ(w.rank, 2);
  EXPECT_EQ(w.size, 3);
  EXPECT_EQ(w.local_rank, 2);
  EXPECT_EQ(w.local_size, 3);
}

TEST(World, Precedence) {
  EXPECT_EQ(detected(merged(merged(kMpirun, kSlurm), kTorchrun)).launcher, "torchrun");
  // mpirun inside a multi-task sbatch allocation: every MPI rank inherits SLURM_PROCID=0, so MPI wins.
  EXPECT_EQ(detected(merged(kMpirun, kSlurm)).launcher, "mpirun");
  EXPECT_EQ(detected(kSlurm).launcher, "slurm");
  EXPECT_EQ(detected(merged(kTorchrun, {{"NIBBLE_LAUNCHER", "nibble"}})).launcher, "nibble --nproc-per-node");
  // A one-task Slurm shell around mpirun: the MPI ranks count.
  EXPECT_EQ(detected(merged(kMpirun, {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}})).launcher, "mpirun");
  // RANK alone (without WORLD_SIZE) does not select torchrun.
  EXPECT_EQ(detected(merged(kMpirun, {{"RANK", "0"}})).launcher, "mpirun");
}

TEST(World, StorePort) {
  EXPECT_EQ(detected({{"MASTER_PORT", "1234"}}).store_port, 1235);
  EXPECT_EQ(detected({{"MASTER_PORT", "1234"}, {"NIBBLE_STORE_PORT", "999"}}).store_port, 999);
  EXPECT_EQ(detected({{"NIBBLE_STORE_PORT", "65535"}}).store_port, 65535);
  EXPECT_EQ(detected({{"MASTER_PORT", ""}}).store_port, 29501);  // empty counts as unset
}

TEST(World, BadValuesNameTheirVariable) {
  struct Case {
    Env env;
    std::string wanted;  // the variable and its value as the message shows them
  };
  const Case cases[] = {
      {{{"RANK", "abc"}, {"WORLD_SIZE", "2"}}, "RANK='abc'"},
      {{{"RANK", "1x"}, {"WORLD_SIZE", "2"}}, "RANK='1x'"},
      {{{"RANK", " 1"}, {"WORLD_SIZE", "2"}}, "RANK=' 1'"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "99999999999"}}, "WORLD_SIZE='99999999999'"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "0"}}, "WORLD_SIZE=0"},
      {{{"RANK", "4"}, {"WORLD_SIZE", "4"}}, "RANK=4"},
      {{{"RANK", "-1"}, {"WORLD_SIZE", "4"}}, "RANK=-1"},
      {merged(kTorchrun, {{"LOCAL_RANK", "4"}}), "LOCAL_RANK=4"},
      {merged(kTorchrun, {{"LOCAL_WORLD_SIZE", "9"}}), "LOCAL_WORLD_SIZE=9"},
      {merged(kTorchrun, {{"LOCAL_WORLD_SIZE", "zero"}}), "LOCAL_WORLD_SIZE='zero'"},
      {{{"MASTER_PORT", "0"}}, "MASTER_PORT=0"},
      {{{"MASTER_PORT", "70000"}}, "MASTER_PORT=70000"},
      {{{"MASTER_PORT", "65535"}}, "MASTER_PORT=65535"},
      {{{"MASTER_PORT", "http"}}, "MASTER_PORT='http'"},
      {{{"NIBBLE_STORE_PORT", "-5"}}, "NIBBLE_STORE_PORT=-5"},
      {merged(kSlurm, {{"SLURM_NTASKS", "four"}}), "SLURM_NTASKS='four'"},
      {merged(kSlurm, {{"SLURM_PROCID", "4"}}), "SLURM_PROCID=4"},
      {merged(kSlurm, {{"SLURM_LOCALID", "2"}}), "SLURM_LOCALID=2"},
      {merged(kSlurm, {{"SLURM_LOCALID", ""}}), "SLURM_LOCALID is not set"},
      {merged(kSlurm, {{"SLURM_NNODES", "0"}}), "SLURM_NNODES=0"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "5"}, {"SLURM_LOCALID", "0"}, {"SLURM_NNODES", "2"}}, "SLURM_NTASKS=5"},
      {merged(kMpirun, {{"OMPI_COMM_WORLD_RANK", "3"}}), "OMPI_COMM_WORLD_RANK=3"},
      {merged(kMpirun, {{"OMPI_COMM_WORLD_LOCAL_RANK", "x"}}), "OMPI_COMM_WORLD_LOCAL_RANK='x'"},
  };
  for (const Case& c : cases) {
    const std::string msg = error_of(c.env);
    EXPECT_NE(msg.find(c.wanted), std::string::npos) << "wanted '" << c.wanted << "' in: " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

TEST(World, MultiNodeWithoutMasterAddrIsAnError) {
  Env slurm = kSlurm;
  slurm.erase("MASTER_ADDR");
  std::string msg = error_of(slurm);
  EXPECT_NE(msg.find("SLURM_NNODES=2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("export MASTER_ADDR"), std::string::npos) << msg;
  Env torchrun = kTorchrun;
  torchrun.erase("MASTER_ADDR");
  msg = error_of(torchrun);
  EXPECT_NE(msg.find("LOCAL_WORLD_SIZE=4"), std::string::npos) << msg;
  EXPECT_NE(msg.find("export MASTER_ADDR"), std::string::npos) << msg;
  msg = error_of(merged(kMpirun, {{"OMPI_COMM_WORLD_LOCAL_SIZE", "1"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}}));
  EXPECT_NE(msg.find("MASTER_ADDR"), std::string::npos) << msg;
}
