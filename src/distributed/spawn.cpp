// spawn_local_ranks: every child's argv and environment are built before fork(), because the child of
// a threaded process may only make async-signal-safe calls until execve (no setenv, no malloc). The
// parent then supervises: it polls waitpid every 20 ms, forwards SIGINT/SIGTERM, and stops the other
// ranks when one fails (a rank left alone would hang in its next collective).
#include "distributed/spawn.h"
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <thread>

extern char** environ;

namespace nb::dist {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Binds `port` (0: any) on all interfaces; the socket (kept open so the port stays taken) or -1.
int bind_port(int port, int* bound) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(uint16_t(port));
  socklen_t len = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(fd);
    return -1;
  }
  *bound = ntohs(addr.sin_port);
  return fd;
}

Status parse_port(const char* name, const char* text, int* port) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || errno != 0 || v < 1 || v > 65535)
    return errorf("%s='%s' is not a TCP port (1..65535): set it to a free port or unset it", name, text);
  *port = int(v);
  return Status::ok();
}

// MASTER_PORT as set, else a free pair; the store port as set, else MASTER_PORT + 1.
Status pick_ports(int* master, int* store) {
  const char* mp = std::getenv("MASTER_PORT");
  const char* sp = std::getenv("NIBBLE_STORE_PORT");
  if (mp && *mp) {
    NB_TRY(parse_port("MASTER_PORT", mp, master));
  } else {
    NB_TRY(find_free_port_pair(master));
  }
  if (sp && *sp) return parse_port("NIBBLE_STORE_PORT", sp, store);
  if (*master == 65535)
    return errorf("MASTER_PORT=65535 leaves no port above it for the rendezvous store: set NIBBLE_STORE_PORT");
  *store = *master + 1;
  return Status::ok();
}

// The parent's environment minus the launch variables, plus this rank's.
std::vector<std::string> rank_env(int rank, int n, int master_port, int store_port) {
  static constexpr std::string_view kOurs[] = {"RANK",        "WORLD_SIZE",  "LOCAL_RANK",        "LOCAL_WORLD_SIZE",
                                               "MASTER_ADDR", "MASTER_PORT", "NIBBLE_STORE_PORT", "NIBBLE_LAUNCHER"};
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string_view kv(*e);
    const std::string_view name = kv.substr(0, kv.find('='));
    if (std::find(std::begin(kOurs), std::end(kOurs), name) == std::end(kOurs)) env.emplace_back(kv);
  }
  for (const char* v : {"RANK=", "LOCAL_RANK="}) env.push_back(v + std::to_string(rank));
  for (const char* v : {"WORLD_SIZE=", "LOCAL_WORLD_SIZE="}) env.push_back(v + std::to_string(n));
  env.push_back("MASTER_ADDR=127.0.0.1");
  env.push_back("MASTER_PORT=" + std::to_string(master_port));
  env.push_back("NIBBLE_STORE_PORT=" + std::to_string(store_port));
  env.push_back("NIBBLE_LAUNCHER=nibble");
  return env;
}

std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (std::string& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// Forks one rank; in the child only async-signal-safe calls happen before execve.
pid_t start_rank(char* const* argv, char* const* envp, const std::string& exec_failed, pid_t parent) {
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
#ifdef __linux__
  // If the parent dies (even by SIGKILL), the ranks get SIGTERM instead of running on unsupervised.
  // Linux ties this to the forking thread, hence spawn_local_ranks belongs on the main thread.
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (::getppid() != parent) ::_exit(127);
#endif
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  ::execve(argv[0], argv, envp);
  (void)!::write(STDERR_FILENO, exec_failed.data(), exec_failed.size());
  ::_exit(127);
}

// Signals received while supervising; lock-free atomics are safe to touch from a handler.
std::atomic<int> g_pending_int{0}, g_pending_term{0};
extern "C" void on_forwarded_signal(int sig) { (sig == SIGINT ? g_pending_int : g_pending_term).fetch_add(1); }

struct ForwardSignals {
  struct sigaction old_int {};
  struct sigaction old_term {};
  ForwardSignals() {
    g_pending_int = g_pending_term = 0;
    struct sigaction sa {};
    sa.sa_handler = on_forwarded_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
  }
  ~ForwardSignals() {
    sigaction(SIGINT, &old_int, nullptr);
    sigaction(SIGTERM, &old_term, nullptr);
  }
};

struct Rank {
  pid_t pid = -1;
  bool done = false;
  int status = 0;  // waitpid's
};

void signal_alive(const std::vector<Rank>& ranks, int sig) {
  for (const Rank& r : ranks)
    if (!r.done) ::kill(r.pid, sig);
}

bool failed(int status) { return !WIFEXITED(status) || WEXITSTATUS(status) != 0; }

std::string how(int rank, int status) {
  if (WIFEXITED(status)) return strprintf("rank %d exited with code %d", rank, WEXITSTATUS(status));
  const int sig = WTERMSIG(status);
  return strprintf("rank %d was killed by signal %d (%s)", rank, sig, strsignal(sig));
}

// Waits for every rank; returns the index of the first that failed, or -1.
int supervise(std::vector<Rank>& ranks, milliseconds grace, std::string* forwarded) {
  int first = -1;
  auto kill_at = Clock::time_point::max();
  for (size_t alive = ranks.size(); alive > 0;) {
    if (g_pending_int.exchange(0) > 0) signal_alive(ranks, SIGINT), *forwarded = "SIGINT";
    if (g_pending_term.exchange(0) > 0) signal_alive(ranks, SIGTERM), *forwarded = "SIGTERM";
    for (size_t i = 0; i < ranks.size(); ++i) {
      Rank& r = ranks[i];
      if (r.done) continue;
      const pid_t got = ::waitpid(r.pid, &r.status, WNOHANG);
      if (got == 0 || (got < 0 && errno == EINTR)) continue;
      if (got < 0) r.status = W_EXITCODE(255, 0);  // reaped elsewhere (SIGCHLD ignored?): count it as failed
      r.done = true;
      --alive;
      if (first < 0 && failed(r.status)) {
        first = int(i);
        signal_alive(ranks, SIGTERM);
        kill_at = Clock::now() + grace;
      }
    }
    if (Clock::now() >= kill_at) signal_alive(ranks, SIGKILL), kill_at = Clock::time_point::max();
    if (alive > 0) std::this_thread::sleep_for(milliseconds(20));
  }
  return first;
}

}  // namespace

Status find_free_port_pair(int* port) {
  for (int attempt = 0; attempt < 100; ++attempt) {
    int p = 0, q = 0;
    const int a = bind_port(0, &p);
    if (a < 0)
      return errorf("cannot bind a TCP socket to find a free port (%s): set MASTER_PORT", std::strerror(errno));
    const int b = p < 65535 ? bind_port(p + 1, &q) : -1;
    ::close(a);
    if (b >= 0) ::close(b);
    if (b >= 0) return *port = p, Status::ok();
  }
  return errorf("found no free TCP port P with P + 1 free too in 100 tries: set MASTER_PORT to a free port");
}

Status spawn_local_ranks(int n, const std::vector<std::string>& argv, std::chrono::milliseconds grace, int* exit_code) {
  *exit_code = 1;
  if (n < 1) return errorf("--nproc-per-node %d must be at least 1", n);
  NB_CHECK(!argv.empty());
  if (::access(argv[0].c_str(), X_OK) != 0)
    return errorf("cannot run %s to start the ranks (%s): pass the executable's path", argv[0].c_str(),
                  std::strerror(errno));
  int master_port = 0, store_port = 0;
  NB_TRY(pick_ports(&master_port, &store_port));
  std::vector<std::string> args = argv;
  std::vector<char*> arg_ptrs = c_strings(args);
  std::vector<std::vector<std::string>> envs;
  std::vector<std::vector<char*>> env_ptrs;
  for (int r = 0; r < n; ++r) envs.push_back(rank_env(r, n, master_port, store_port));
  for (auto& e : envs) env_ptrs.push_back(c_strings(e));
  const std::string exec_failed = "nibble: could not execute " + argv[0] + "\n";

  ForwardSignals forward;
  std::vector<Rank> ranks(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    ranks[size_t(r)].pid = start_rank(arg_ptrs.data(), env_ptrs[size_t(r)].data(), exec_failed, ::getpid());
    if (ranks[size_t(r)].pid > 0) continue;
    const int err = errno;
    ranks.resize(size_t(r));
    signal_alive(ranks, SIGKILL);
    for (Rank& k : ranks) ::waitpid(k.pid, &k.status, 0);
    return errorf("could not start rank %d of %d (fork: %s)", r, n, std::strerror(err));
  }
  std::string forwarded;
  const int first = supervise(ranks, grace, &forwarded);
  if (first < 0) return *exit_code = 0, Status::ok();
  const int status = ranks[size_t(first)].status;
  *exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  const std::string prefix = forwarded.empty() ? "" : forwarded + " was forwarded to the ranks; ";
  return errorf("%s%s%s", prefix.c_str(), how(first, status).c_str(), n > 1 ? "; the other ranks were stopped" : "");
}

}  // namespace nb::dist
