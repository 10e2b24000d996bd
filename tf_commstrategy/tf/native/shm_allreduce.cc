// TfcsShmAllReduce: the all-reduce of a list of float tensors among the ranks of ONE host, through a
// shared-memory segment that every rank maps, as a compiled TensorFlow op.
//
// Why: on the host path the collective is otherwise a tf.numpy_function (the GIL, a Python call, and
// the gradients concatenated before it and split after it). This op reads the input tensors where
// they are and writes the outputs it allocates: no Python, no concat, no split.
//
// Built on first use by tf_commstrategy/tf/native_build.py (g++ and TensorFlow's headers); Python
// (native_path.py) creates the segment and maps it in every rank, then registers it in this library's
// process-wide table under the segment's name (TfcsShmRegister, through ctypes) with its address, this
// rank, the ranks' pids and the layout. The op's `segment` attribute holds only that name: the kernel
// looks it up when it runs, so a graph holds no address, and a graph run in another process (exported
// and loaded elsewhere), or after its process group shut down, fails with a tagged error instead of
// touching memory that is not the segment.
//
// Segment layout (every word 64-byte aligned, each rank writes only its own lines):
//   line [0 * size + r]  ready[r]: the generation whose data rank r has put in its slot
//   line [1 * size + r]  done[r]:  the generation rank r has finished reading every slot for
//   line [2 * size + r]  state[r]: 0 while healthy, else why rank r stopped (kShutdown, kMismatch, ...;
//                        kFailed: set by Python when the process group failed, so a waiting call ends;
//                        kDiverged: also set by Python when its wait found the ranks split between
//                        this op and a collective of the Python path)
//   line [3 * size + r]  sig[r][2], calls[r], busy_ns[r], wait_ns[r], native_since[r], python_since[r]:
//                        the signatures of rank r's pieces in slot 0 and 1 (a rank may publish
//                        generation g + 1 while a peer still checks g); its calls so far; the nanoseconds
//                        they took; the part of those spent waiting for peers (a peer's data not there
//                        yet, or a slot still being read); since when (CLOCK_MONOTONIC ns, 0: not) rank
//                        r is inside this op, and (written by Python) inside a collective of the
//                        tf_commstrategy Python path
//   data at header_bytes: rank r's two slots of `capacity` bytes (generation g uses slot g & 1)
//
// One generation per piece of at most `capacity` bytes of the concatenated inputs: each rank copies
// its piece into its slot, publishes ready (release), waits for every peer's ready (acquire), checks
// their signatures, then sums every slot IN RANK ORDER into its outputs (so every rank gets the same
// bits) and publishes done. A slot is rewritten only after every peer's done reached g - 2.
//
// Every wait has a deadline, watches every peer's state word (a peer that stopped fails this call at
// once), and checks every 50 ms that the peers' processes are alive, and whether a peer has been inside
// a collective of the Python path for `diverge_s` seconds while this call has waited as long: the ranks
// then called different collectives, which no deadline short of the timeout would report. Errors carry
// a tag that tf_commstrategy turns into its typed errors: "[tfcs-native:timeout]",
// "[tfcs-native:mismatch]", "[tfcs-native:diverged:R]", "[tfcs-native:peer_lost:R]",
// "[tfcs-native:aborted:R]", "[tfcs-native:shutdown]", "[tfcs-native:unregistered]".
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

using namespace tensorflow;  // NOLINT

REGISTER_OP("TfcsShmAllReduce")
    .Input("inputs: N * T")
    .Output("outputs: N * T")
    .Attr("N: int >= 1")
    .Attr("T: {float, double}")
    .Attr("segment: string")
    .Attr("timeout: float")
    .Attr("spin_us: int")
    .Attr("mean: bool = false")
    .Attr("diverge_s: float = 5.0")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return OkStatus();
    });

namespace {

constexpr uint64_t kShutdown = 1, kMismatch = 2, kTimeout = 3, kPeerLost = 4, kFailed = 5, kDiverged = 6;

using Clock = std::chrono::steady_clock;  // CLOCK_MONOTONIC: Python's time.monotonic_ns() reads the same

uint64_t MonotonicNs(Clock::time_point t) {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count());
}

class Segment {
 public:
  Segment(char* base, int size, int64_t header) : base_(base), size_(size), header_(header) {}
  std::atomic<uint64_t>* line(int kind, int r) const {
    return reinterpret_cast<std::atomic<uint64_t>*>(base_ + 64 * (kind * size_ + r));
  }
  std::atomic<uint64_t>* ready(int r) const { return line(0, r); }
  std::atomic<uint64_t>* done(int r) const { return line(1, r); }
  std::atomic<uint64_t>* state(int r) const { return line(2, r); }
  // one signature per slot: a rank may publish generation g + 1 while a peer still checks generation g
  std::atomic<uint64_t>* sig(int r, uint64_t gen) const { return line(3, r) + (gen & 1); }
  std::atomic<uint64_t>* calls(int r) const { return line(3, r) + 2; }
  std::atomic<uint64_t>* busy_ns(int r) const { return line(3, r) + 3; }
  std::atomic<uint64_t>* wait_ns(int r) const { return line(3, r) + 4; }
  std::atomic<uint64_t>* native_since(int r) const { return line(3, r) + 5; }
  std::atomic<uint64_t>* python_since(int r) const { return line(3, r) + 6; }
  char* slot(int r, uint64_t gen, int64_t capacity) const {
    return base_ + header_ + (int64_t(r) * 2 + int64_t(gen & 1)) * capacity;
  }

 private:
  char* base_;
  int size_;
  int64_t header_;
};

uint64_t mix(uint64_t h, uint64_t v) {  // FNV-1a over the 8 bytes of v
  for (int i = 0; i < 8; ++i) {
    h ^= (v >> (8 * i)) & 0xff;
    h *= 1099511628211ULL;
  }
  return h;
}

std::mutex& CallMutex() {
  static std::mutex mu;
  return mu;
}

// One registered segment: where this process mapped it and what the op needs to use it. Entries are
// never erased (a process makes one per process group), so a kernel may keep the pointer it found;
// `shut_down` is written under both CallMutex() and RegistryMutex(), and read under either.
struct Registered {
  char* base = nullptr;
  size_t length = 0;
  int64_t header = 0, capacity = 0;
  int rank = 0, size = 0;
  std::vector<int64_t> pids;  // every rank's process, checked while waiting for it
  bool shut_down = false;
};

std::mutex& RegistryMutex() {  // taken after CallMutex() where both are held
  static std::mutex mu;
  return mu;
}

std::unordered_map<std::string, std::shared_ptr<Registered>>& Registry() {
  static auto* table = new std::unordered_map<std::string, std::shared_ptr<Registered>>();  // never freed:
  return *table;  // a kernel may run while the process exits
}

std::shared_ptr<Registered> Lookup(const std::string& name) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(name);
  return it == Registry().end() ? nullptr : it->second;
}

// A peer process that exists and is not a zombie (kill(pid, 0) succeeds for a zombie too).
bool alive(int64_t pid) {
  if (pid <= 0) return true;
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  char path[64];
  snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = fopen(path, "r");
  if (f == nullptr) return true;  // no /proc: kill() said it exists
  char buf[512];
  const size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = 0;
  const char* close_paren = strrchr(buf, ')');  // "pid (comm) S ...": the state follows the name
  return close_paren == nullptr || close_paren[1] == 0 || close_paren[2] != 'Z';
}

const char* StoppedBecause(uint64_t st) {
  switch (st) {
    case kShutdown: return "left the job (shut down)";
    case kTimeout: return "timed out in an all-reduce";
    case kPeerLost: return "lost a peer process";
    case kFailed: return "failed (see its log)";
    case kDiverged: return "found that the ranks called different collectives (see its log)";
    default: return "stopped";
  }
}

}  // namespace

// Called by Python (ctypes) once every rank has mapped the segment: `name` (the op's `segment`
// attribute) -> the mapping at `addr` of `length` bytes, its layout, this rank and every rank's pid.
// Returns 0, EINVAL for an inconsistent layout, or EEXIST for a name registered already.
extern "C" int TfcsShmRegister(const char* name, void* addr, size_t length, int64_t header_bytes,
                               int64_t capacity, int rank, int size, const int64_t* pids) {
  if (name == nullptr || addr == nullptr || pids == nullptr || size < 2 || rank < 0 || rank >= size ||
      capacity < 64 || capacity % 64 != 0 || header_bytes < 64 * 4 * int64_t(size) ||
      int64_t(length) < header_bytes + 2 * int64_t(size) * capacity) {
    return EINVAL;
  }
  auto entry = std::make_shared<Registered>();
  entry->base = static_cast<char*>(addr);
  entry->length = length;
  entry->header = header_bytes;
  entry->capacity = capacity;
  entry->rank = rank;
  entry->size = size;
  entry->pids.assign(pids, pids + size);
  std::lock_guard<std::mutex> lock(RegistryMutex());
  return Registry().emplace(name, std::move(entry)).second ? 0 : EEXIST;
}

// Called by Python at shutdown (ctypes), after it set this rank's state word: waits for a call in
// progress to end (it sees the state within 50 ms), marks the name shut down (a graph that still runs
// the op fails cleanly, without touching the segment), and replaces the shared pages with private
// memory whose state word for this rank says "shut down" (Python's own views of the segment stay
// valid while the shared pages go back). Returns 0, ENOENT for a name never registered, or errno.
extern "C" int TfcsShmRelease(const char* name) {
  std::lock_guard<std::mutex> call(CallMutex());
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(name == nullptr ? std::string() : std::string(name));
  if (it == Registry().end()) return ENOENT;
  Registered& r = *it->second;
  if (r.shut_down) return 0;
  r.shut_down = true;
  void* got = mmap(r.base, r.length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  if (got != r.base) return errno;
  Segment(r.base, r.size, 0).state(r.rank)->store(kShutdown, std::memory_order_release);
  return 0;
}

template <typename T>
class ShmAllReduceOp : public OpKernel {
 public:
  explicit ShmAllReduceOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("segment", &segment_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("timeout", &timeout_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("spin_us", &spin_us_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("mean", &mean_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("diverge_s", &diverge_s_));
    OP_REQUIRES(ctx, !segment_.empty() && diverge_s_ > 0,
                errors::InvalidArgument("[tfcs-native:config] inconsistent attributes"));
  }

  // The registered segment of this op's name, found once per kernel (entries are never erased), with
  // its layout copied into the members that Compute() and Wait() use. False (and the status set) when
  // this process has no such segment, or its process group shut down. Called under CallMutex().
  bool Attach(OpKernelContext* ctx) {
    if (reg_ == nullptr) {
      reg_ = Lookup(segment_);
      if (reg_ == nullptr) {
        ctx->SetStatus(errors::FailedPrecondition(
            "[tfcs-native:unregistered] the compiled all-reduce's shared-memory segment ", segment_,
            " is not registered in this process (pid ", getpid(), "): a graph with this op runs only in "
            "the process that traced it, while its process group lives"));
        return false;
      }
      seg_ = Segment(reg_->base, reg_->size, reg_->header);
      rank_ = reg_->rank;
      size_ = reg_->size;
      capacity_ = reg_->capacity;
    }
    if (reg_->shut_down) {
      ctx->SetStatus(errors::FailedPrecondition("[tfcs-native:shutdown] rank ", rank_,
                                                ": the process group was shut down"));
      return false;
    }
    return true;
  }

  void Compute(OpKernelContext* ctx) override {
    const auto entered = Clock::now();  // the deadline counts from here, the wait for the mutex included
    // One call at a time per process: the generation is the segment's (this rank's ready word), shared
    // by every node and function that runs this op, as every rank runs the same calls in the same order.
    std::lock_guard<std::mutex> lock(CallMutex());
    if (!Attach(ctx)) return;  // before anything touches the segment, and before Exit marks it failed
    const Segment& s = seg_;
    const uint64_t own = s.state(rank_)->load(std::memory_order_acquire);
    if (own != 0) {
      ctx->SetStatus(errors::FailedPrecondition(
          own == kShutdown ? "[tfcs-native:shutdown] rank " : "[tfcs-native:failed] rank ", rank_,
          own == kShutdown ? ": the process group was shut down"
                           : ": an earlier all-reduce failed; the process group is unusable"));
      return;
    }
    uint64_t gen = s.ready(rank_)->load(std::memory_order_relaxed);
    const int n = ctx->num_inputs();
    std::vector<const T*> in(n);
    std::vector<T*> out(n);
    std::vector<int64_t> len(n);
    int64_t total = 0;
    uint64_t shape_sig = 1469598103934665603ULL;
    waited_ns_ = 0;  // Wait() adds to it (calls are serialized by the mutex)
    struct Exit {  // however the call ends: its time into busy_ns, the waits into wait_ns; a failure marks
      const Segment& s;  // this rank stopped, so peers waiting for it fail at once instead of at their deadline
      int rank;
      Clock::time_point t0;
      OpKernelContext* ctx;
      const int64_t& waited;
      ~Exit() {
        s.native_since(rank)->store(0, std::memory_order_release);
        s.busy_ns(rank)->fetch_add(
            uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count()),
            std::memory_order_relaxed);
        s.wait_ns(rank)->fetch_add(uint64_t(waited), std::memory_order_relaxed);
        uint64_t healthy = 0;
        if (!ctx->status().ok()) s.state(rank)->compare_exchange_strong(healthy, kFailed, std::memory_order_acq_rel);
      }
    } exit{s, rank_, entered, ctx, waited_ns_};
    s.native_since(rank_)->store(MonotonicNs(entered), std::memory_order_release);
    s.calls(rank_)->fetch_add(1, std::memory_order_relaxed);
    for (int i = 0; i < n; ++i) {
      const Tensor& t = ctx->input(i);
      Tensor* o = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, t.shape(), &o));
      in[i] = t.flat<T>().data();
      out[i] = o->flat<T>().data();
      len[i] = t.NumElements();
      total += len[i];
      shape_sig = mix(shape_sig, uint64_t(t.dims()));
      for (int d = 0; d < t.dims(); ++d) shape_sig = mix(shape_sig, uint64_t(t.dim_size(d)));
    }
    shape_sig = mix(mix(mix(shape_sig, uint64_t(n)), uint64_t(sizeof(T))), uint64_t(mean_));
    const int64_t per_slot = capacity_ / int64_t(sizeof(T));
    const T divisor = T(size_);
    int ti = 0;
    int64_t toff = 0;  // where the next piece starts: tensor ti, element toff
    int64_t piece_no = 0;
    for (int64_t start = 0; start < total || (total == 0 && piece_no == 0); ++piece_no) {
      const int64_t piece = std::min(per_slot, total - start);
      const uint64_t g = ++gen;
      for (int p = 0; p < size_; ++p) {  // every peer has finished reading my slot of generation g - 2
        if (p != rank_ && g > 2 && !Wait(ctx, s.done(p), g - 2, entered)) return;
      }
      T* mine = reinterpret_cast<T*>(s.slot(rank_, g, capacity_));
      {
        int64_t k = 0, o = toff;
        int i = ti;
        while (k < piece) {
          const int64_t c = std::min(piece - k, len[i] - o);
          std::memcpy(mine + k, in[i] + o, c * sizeof(T));
          k += c;
          o += c;
          if (o == len[i]) { ++i; o = 0; }
        }
      }
      const uint64_t sig = mix(mix(mix(shape_sig, uint64_t(total)), uint64_t(piece_no)), g);
      s.sig(rank_, g)->store(sig, std::memory_order_relaxed);
      s.ready(rank_)->store(g, std::memory_order_release);
      for (int p = 0; p < size_; ++p) {
        if (p != rank_ && !Wait(ctx, s.ready(p), g, entered)) return;
      }
      for (int p = 0; p < size_; ++p) {
        const uint64_t theirs = s.sig(p, g)->load(std::memory_order_relaxed);
        if (theirs != sig) {
          s.state(rank_)->store(kMismatch, std::memory_order_release);
          std::string shapes;  // this rank's side, for the message (the peer's is not in the segment)
          for (int i = 0; i < n; ++i) shapes += (i ? ", " : "") + ctx->input(i).shape().DebugString();
          ctx->SetStatus(errors::FailedPrecondition(
              "[tfcs-native:mismatch] rank ", rank_, ": rank ", p, " called the all-reduce with other "
              "tensors (this rank: ", n, " tensors of shapes ", shapes, "; ", total, " elements of ", sizeof(T),
              " bytes", mean_ ? ", MEAN" : ", SUM", ")"));
          return;
        }
      }
      std::vector<const T*> slots(size_);
      for (int r = 0; r < size_; ++r) slots[r] = reinterpret_cast<const T*>(s.slot(r, g, capacity_));
      int64_t k = 0;
      while (k < piece) {
        const int64_t c = std::min(piece - k, len[ti] - toff);
        T* dst = out[ti] + toff;
        const T* s0 = slots[0] + k;
        if (size_ == 2) {
          const T* s1 = slots[1] + k;
          if (mean_) {  // divided, as the Python path divides (not multiplied by 1 / size)
            for (int64_t j = 0; j < c; ++j) dst[j] = (s0[j] + s1[j]) / divisor;
          } else {
            for (int64_t j = 0; j < c; ++j) dst[j] = s0[j] + s1[j];
          }
        } else {
          for (int64_t j = 0; j < c; ++j) dst[j] = s0[j];
          for (int r = 1; r < size_; ++r) {
            const T* sr = slots[r] + k;
            for (int64_t j = 0; j < c; ++j) dst[j] += sr[j];
          }
          if (mean_) for (int64_t j = 0; j < c; ++j) dst[j] /= divisor;
        }
        k += c;
        toff += c;
        if (toff == len[ti]) { ++ti; toff = 0; }
      }
      s.done(rank_)->store(g, std::memory_order_release);
      start += piece;
      if (total == 0) break;
    }
  }

 private:
  // Wait until *word >= target. False (and the status set) on a deadline, a peer that stopped or died.
  // `entered`: when the call began; its deadline is `timeout_` seconds later (compared as a double, so
  // any timeout, however large, is a real one).
  bool Wait(OpKernelContext* ctx, std::atomic<uint64_t>* word, uint64_t target, Clock::time_point entered) {
    if (word->load(std::memory_order_acquire) >= target) return true;
    const Segment& s = seg_;
    const auto start = Clock::now();
    struct Waited {  // however the wait ends, its time counts
      int64_t& total;
      Clock::time_point start;
      ~Waited() {
        total += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
      }
    } waited{waited_ns_, start};
    auto next_check = start;
    for (uint64_t spins = 0;; ++spins) {
      if (word->load(std::memory_order_acquire) >= target) return true;
      const auto now = Clock::now();
      const double waited_us = std::chrono::duration<double, std::micro>(now - start).count();
      if (waited_us < spin_us_) {
        sched_yield();
        continue;
      }
      if (now >= next_check) {
        next_check = now + std::chrono::milliseconds(50);
        for (int p = 0; p < size_; ++p) {  // a dead process first: it is the cause, not the ranks it stopped
          if (p != rank_ && !alive(reg_->pids[p])) {
            s.state(rank_)->store(kPeerLost, std::memory_order_release);
            ctx->SetStatus(errors::Unavailable("[tfcs-native:peer_lost:", p, "] rank ", rank_, ": rank ", p,
                                               " (pid ", reg_->pids[p], ") died during the all-reduce"));
            return false;
          }
        }
        // the cause first: a peer that found a mismatch or a divergence also aborts the group, and its
        // abort may reach this rank (its own word then says "failed") before this loop runs
        int stopped = -1;
        for (int p = 0; p < size_ && stopped < 0; ++p) {
          const uint64_t st = s.state(p)->load(std::memory_order_acquire);
          if (p != rank_ && (st == kMismatch || st == kDiverged)) stopped = p;
        }
        for (int p = 0; p < size_ && stopped < 0; ++p) {
          if (s.state(p)->load(std::memory_order_acquire) != 0) stopped = p;
        }
        if (stopped >= 0) {
          const int p = stopped;
          const uint64_t st = s.state(p)->load(std::memory_order_acquire);
          if (p == rank_) {  // this rank's process group failed (Python set the word): stop now
            ctx->SetStatus(errors::FailedPrecondition(
                st == kShutdown ? "[tfcs-native:shutdown] rank " : "[tfcs-native:failed] rank ", rank_,
                st == kShutdown ? ": the process group was shut down while this all-reduce waited"
                                : ": the process group failed while this all-reduce waited"));
          } else if (st == kMismatch) {
            ctx->SetStatus(errors::FailedPrecondition(
                "[tfcs-native:mismatch] rank ", rank_, ": rank ", p, " found that the ranks called the "
                "all-reduce with different tensors"));
          } else if (st == kDiverged) {  // the peer found it first (from its side): the same error here
            ctx->SetStatus(errors::FailedPrecondition(
                "[tfcs-native:diverged:", p, "] rank ", rank_, ": rank ", p, " found that the ranks called "
                "different collectives while this rank waited in the compiled all-reduce of the strategy's "
                "gradients"));
          } else {
            ctx->SetStatus(errors::Aborted("[tfcs-native:aborted:", p, "] rank ", rank_, ": rank ", p, " ",
                                           StoppedBecause(st)));
          }
          return false;
        }
        if (std::chrono::duration<double>(now - entered).count() >= diverge_s_) {
          // a peer inside a Python-path collective all this time does not come to this one
          const uint64_t now_ns = MonotonicNs(now);
          for (int p = 0; p < size_; ++p) {
            const uint64_t since = p == rank_ ? 0 : s.python_since(p)->load(std::memory_order_acquire);
            if (since != 0 && now_ns > since && double(now_ns - since) * 1e-9 >= diverge_s_) {
              s.state(rank_)->store(kDiverged, std::memory_order_release);
              const auto tenths = [](uint64_t ns) { return double(ns / 100000000) / 10; };  // 0.1 s
              ctx->SetStatus(errors::FailedPrecondition(
                  "[tfcs-native:diverged:", p, "] rank ", rank_, ": this rank waited ",
                  tenths(now_ns - MonotonicNs(entered)), " s in the compiled all-reduce of the strategy's "
                  "gradients while rank ", p, " has been in another collective (tf_commstrategy's Python "
                  "path) for ", tenths(now_ns - since), " s: the ranks called different collectives"));
              return false;
            }
          }
        }
        if (std::chrono::duration<double>(now - entered).count() >= timeout_) {
          s.state(rank_)->store(kTimeout, std::memory_order_release);
          ctx->SetStatus(errors::DeadlineExceeded(
              "[tfcs-native:timeout] rank ", rank_, ": the all-reduce did not complete within ", timeout_,
              " s (waiting for generation ", target, ")"));
          return false;
        }
      }
      // sleep a little, longer as the wait goes on (a rank far behind: evaluation, a checkpoint)
      struct timespec ts = {0, waited_us < 10000 ? 50000 : 1000000};
      nanosleep(&ts, nullptr);
    }
  }

  std::string segment_;                 // the attribute: the registered segment's name
  std::shared_ptr<Registered> reg_;     // what the name was registered as (Attach)
  Segment seg_{nullptr, 0, 0};
  int rank_ = 0, size_ = 0;
  int64_t capacity_ = 0;
  float timeout_ = 0;
  float diverge_s_ = 5;
  int spin_us_ = 0;
  bool mean_ = false;
  int64_t waited_ns_ = 0;  // this call's time in Wait() so far
};

REGISTER_KERNEL_BUILDER(Name("TfcsShmAllReduce").Device(DEVICE_CPU).TypeConstraint<float>("T"),
                        ShmAllReduceOp<float>);
REGISTER_KERNEL_BUILDER(Name("TfcsShmAllReduce").Device(DEVICE_CPU).TypeConstraint<double>("T"),
                        ShmAllReduceOp<double>);
