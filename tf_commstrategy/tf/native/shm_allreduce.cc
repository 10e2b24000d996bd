// TfcsShmAllReduce: the all-reduce of a list of float tensors among the ranks of ONE host, as a compiled
// TensorFlow op that runs the host backend's shared-buffer protocol (backends/host/shm_buffers.py).
//
// Why: on the host path the collective is otherwise a tf.numpy_function (the GIL, a Python call, and
// the gradients concatenated before it and split after it). This op reads the input tensors where
// they are and writes the outputs it allocates: no Python, no concat, no split.
//
// One protocol, one sequencer. The op works in the same shared all-reduce buffers as the host
// backend's Python code, with the same words and slots: every rank's own segment (a header page, then
// a data area whose two halves are the one-round path's slots), mapped by every rank. Python hands
// the op every segment's address and the protocol's layout (word indices and byte offsets, defined
// once in shm_layout.py) when it registers the buffers under a name (TfcsShmRegister, through
// ctypes); the op's `segment` attribute holds only that name, so a graph holds no address, and a
// graph run in another process, or after its process group shut down, fails with a tagged error
// instead of touching memory that is not the segment.
//
// A call is one collective of the backend's sequence: it takes the next collective number from the
// rank's sequence word (the Python path takes its numbers from the same word) and publishes the
// collective it entered (number + signature text) where the Python path publishes its own, under the
// same lock (TfcsTurn, which the Python path holds for each of its collectives). So a rank in this op
// and a peer in another collective of the same number see the mismatch at once, from either side.
// The call's data moves in pieces of at most one slot, one generation each (the rank's ready word
// counts the generations, for both implementations): each rank copies its piece into the slot of the
// generation (g & 1), writes the slot's header (collective number, elements, signature), publishes
// ready = g and rings the peers' bells, waits for every peer's ready, checks their slot headers
// against its own, sums every slot IN RANK ORDER into its outputs (every rank gets the same bits, the
// bits of the Python path's one-round reduction) and publishes done = g. A slot is rewritten only
// after every peer's done reached g - 2 (g - 1 when the rank's last generation used the whole data
// area: the Python path's two-round pieces).
//
// Every wait has a deadline, and every 50 ms checks that the peers' processes are alive, the peers'
// state words (a peer's op that failed says why there; Python sets this rank's own when the process
// group failed) and the collective each peer entered. Errors carry a tag that tf_commstrategy turns
// into its typed errors: "[tfcs-native:timeout]", "[tfcs-native:mismatch:R]",
// "[tfcs-native:peer_lost:R]", "[tfcs-native:aborted:R]", "[tfcs-native:failed]",
// "[tfcs-native:shutdown]", "[tfcs-native:unregistered]".
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

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
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return OkStatus();
    });

namespace {

// the state word's values (native_path.py names them too)
constexpr uint64_t kShutdown = 1, kMismatch = 2, kTimeout = 3, kPeerLost = 4, kFailed = 5;

// The layout Python passes at registration, in this order (shm_layout.COMPILED_LAYOUT): word indices
// (uint64) into a rank's header, then byte offsets.
enum LayoutField {
  kReady, kDone, kSeq, kLastWhole, kState, kEntered, kEnteredLen,  // word indices
  kEnteredText, kDataAt, kSlotStride, kSlotTextAt, kSlotDataAt, kTextMax,  // byte offsets and sizes
  kLayoutFields
};

using Clock = std::chrono::steady_clock;

// One registered set of buffers: every rank's segment as this process mapped it, and what the op needs
// to use them. Entries are never erased (a process makes one per process group), so a kernel may keep
// the pointer it found; `shut_down` is written under both TurnMutex() and RegistryMutex(), and read under
// either.
struct Registered {
  std::vector<char*> bases;   // rank r's segment
  std::vector<int64_t> pids;  // rank r's process, checked while waiting for it
  int64_t layout[kLayoutFields] = {};
  int rank = 0, size = 0;
  bool shut_down = false;
  mutable std::atomic<uint64_t> calls{0}, busy_ns{0}, wait_ns{0};  // this rank's calls, their time, their waits

  std::atomic<uint64_t>* word(int r, LayoutField f) const {
    return reinterpret_cast<std::atomic<uint64_t>*>(bases[r]) + layout[f];
  }
  char* slot(int r, uint64_t gen) const {
    return bases[r] + layout[kDataAt] + int64_t(gen & 1) * layout[kSlotStride];
  }
  // A peer's bell: bump the futex word at its segment's start, wake it only if a thread sleeps there
  // (the count in the next 4 bytes), as core/shared_memory.Bell.ring does.
  void ring(int r) const {
    auto* bell = reinterpret_cast<std::atomic<uint32_t>*>(bases[r]);
    bell->fetch_add(1, std::memory_order_seq_cst);
    if (reinterpret_cast<std::atomic<uint32_t>*>(bases[r] + 4)->load(std::memory_order_seq_cst) != 0) {
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(bell), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
    }
  }
};

// The lock each rank's collectives hold, Python's (through TfcsTurn) and this op's: one collective at
// a time per process, as they share the sequence and the slots.
std::mutex& TurnMutex() {
  static std::mutex mu;
  return mu;
}

std::mutex& RegistryMutex() {  // taken after TurnMutex() where both are held
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
    case kMismatch: return "found that the ranks called different collectives (see its log)";
    case kTimeout: return "timed out in an all-reduce";
    case kPeerLost: return "lost a peer process";
    case kFailed: return "failed (see its log)";
    default: return "stopped";
  }
}

}  // namespace

// Called by Python (ctypes) once every rank has mapped every segment: `name` (the op's `segment`
// attribute) -> the `size` segments' addresses in this process, the protocol's layout (kLayoutFields
// values), this rank and every rank's pid. Returns 0, EINVAL for an inconsistent layout, or EEXIST
// for a name registered already.
extern "C" int TfcsShmRegister(const char* name, const int64_t* bases, const int64_t* layout, int rank, int size,
                               const int64_t* pids) {
  if (name == nullptr || bases == nullptr || layout == nullptr || pids == nullptr || size < 2 || rank < 0 ||
      rank >= size) {
    return EINVAL;
  }
  auto entry = std::make_shared<Registered>();
  std::memcpy(entry->layout, layout, sizeof(entry->layout));
  const int64_t* l = entry->layout;
  if (l[kSlotStride] < l[kSlotDataAt] + 64 || l[kSlotStride] % 64 != 0 || l[kDataAt] % 64 != 0 ||
      l[kSlotTextAt] + l[kTextMax] > l[kSlotDataAt] || l[kEnteredText] + l[kTextMax] > l[kDataAt]) {
    return EINVAL;
  }
  for (int f = kReady; f <= kEnteredLen; ++f) {
    if (l[f] < 0 || (l[f] + 1) * 8 > l[kDataAt]) return EINVAL;
  }
  for (int r = 0; r < size; ++r) {
    if (bases[r] == 0) return EINVAL;
    entry->bases.push_back(reinterpret_cast<char*>(bases[r]));
  }
  entry->rank = rank;
  entry->size = size;
  entry->pids.assign(pids, pids + size);
  std::lock_guard<std::mutex> lock(RegistryMutex());
  return Registry().emplace(name, std::move(entry)).second ? 0 : EEXIST;
}

// Called by Python at shutdown (ctypes), before the buffers are unmapped and after it set this rank's
// state word: waits for a call in progress to end (it sees the state within 50 ms) and marks the name
// shut down, so a graph that still runs the op fails cleanly without touching the segments. Returns 0,
// or ENOENT for a name never registered.
extern "C" int TfcsShmRelease(const char* name) {
  std::lock_guard<std::mutex> turn(TurnMutex());
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(name == nullptr ? std::string() : std::string(name));
  if (it == Registry().end()) return ENOENT;
  it->second->shut_down = true;
  return 0;
}

// The Python path's side of the shared lock: take (1) or give back (0) this process's turn.
extern "C" void TfcsTurn(int take) {
  if (take) {
    TurnMutex().lock();
  } else {
    TurnMutex().unlock();
  }
}

// This rank's counters for `name`: calls, nanoseconds inside the op, nanoseconds of those waiting for
// peers. Returns 0, or ENOENT.
extern "C" int TfcsShmCounters(const char* name, uint64_t* out) {
  auto r = Lookup(name == nullptr ? std::string() : std::string(name));
  if (r == nullptr) return ENOENT;
  out[0] = r->calls.load();
  out[1] = r->busy_ns.load();
  out[2] = r->wait_ns.load();
  return 0;
}

// Write this rank's state word (`value` when it is still 0), or read it (`value` == 0): the previous
// value, or -1 when the name is unknown or shut down (its segments may be gone).
extern "C" int64_t TfcsShmState(const char* name, uint64_t value) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(name == nullptr ? std::string() : std::string(name));
  if (it == Registry().end() || it->second->shut_down) return -1;
  const Registered& r = *it->second;
  uint64_t old = 0;
  if (value != 0 && r.word(r.rank, kState)->compare_exchange_strong(old, value, std::memory_order_acq_rel)) {
    return 0;
  }
  return int64_t(r.word(r.rank, kState)->load(std::memory_order_acquire));
}

template <typename T>
class ShmAllReduceOp : public OpKernel {
 public:
  explicit ShmAllReduceOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("segment", &segment_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("timeout", &timeout_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("spin_us", &spin_us_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("mean", &mean_));
    OP_REQUIRES(ctx, !segment_.empty(), errors::InvalidArgument("[tfcs-native:config] no segment name"));
  }

  // The registered buffers of this op's name, found once per kernel (entries are never erased). False
  // (and the status set) when this process has none, or its process group shut down. Called under
  // TurnMutex().
  bool Attach(OpKernelContext* ctx) {
    if (reg_ == nullptr) {
      reg_ = Lookup(segment_);
      if (reg_ == nullptr) {
        ctx->SetStatus(errors::FailedPrecondition(
            "[tfcs-native:unregistered] the compiled all-reduce's shared-memory buffers ", segment_,
            " are not registered in this process (pid ", getpid(), "): a graph with this op runs only in "
            "the process that traced it, while its process group lives"));
        return false;
      }
    }
    if (reg_->shut_down) {
      ctx->SetStatus(errors::FailedPrecondition("[tfcs-native:shutdown] rank ", reg_->rank,
                                                ": the process group was shut down"));
      return false;
    }
    return true;
  }

  void Compute(OpKernelContext* ctx) override {
    const auto entered = Clock::now();  // the deadline counts from here, the wait for the turn included
    std::lock_guard<std::mutex> turn(TurnMutex());
    if (!Attach(ctx)) return;  // before anything touches the segments
    const Registered& g = *reg_;
    const int me = g.rank;
    const uint64_t own = g.word(me, kState)->load(std::memory_order_acquire);
    if (own != 0) {
      ctx->SetStatus(errors::FailedPrecondition(
          own == kShutdown ? "[tfcs-native:shutdown] rank " : "[tfcs-native:failed] rank ", me,
          own == kShutdown ? ": the process group was shut down"
                           : ": an earlier collective failed; the process group is unusable"));
      return;
    }
    const int n = ctx->num_inputs();
    std::vector<const T*> in(n);
    std::vector<T*> out(n);
    std::vector<int64_t> len(n);
    int64_t total = 0;
    for (int i = 0; i < n; ++i) {
      const Tensor& t = ctx->input(i);
      Tensor* o = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, t.shape(), &o));
      in[i] = t.flat<T>().data();
      out[i] = o->flat<T>().data();
      len[i] = t.NumElements();
      total += len[i];
    }
    waited_ns_ = 0;
    struct Exit {  // however the call ends: its time and waits counted; a failure marks this rank
      const Registered& g;  // stopped, so peers waiting for it fail at once instead of at their deadline
      Clock::time_point t0;
      OpKernelContext* ctx;
      const int64_t& waited;
      ~Exit() {
        g.busy_ns.fetch_add(uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                Clock::now() - t0).count()), std::memory_order_relaxed);
        g.wait_ns.fetch_add(uint64_t(waited), std::memory_order_relaxed);
        uint64_t healthy = 0;
        if (!ctx->status().ok()) {
          g.word(g.rank, kState)->compare_exchange_strong(healthy, kFailed, std::memory_order_acq_rel);
        }
      }
    } exit{g, entered, ctx, waited_ns_};
    g.calls.fetch_add(1, std::memory_order_relaxed);
    // the collective's number, from the sequence the Python path numbers its collectives by
    seq_ = g.word(me, kSeq)->load(std::memory_order_relaxed);
    g.word(me, kSeq)->store(seq_ + 1, std::memory_order_relaxed);
    text_ = std::string("allreduce(compiled) ") + (sizeof(T) == 4 ? "float32 " : "float64 ") +
            (mean_ ? "MEAN " : "SUM ") + std::to_string(total) + " elements in " + std::to_string(n) + " tensors";
    Enter();
    const int64_t per_slot = (g.layout[kSlotStride] - g.layout[kSlotDataAt]) / int64_t(sizeof(T));
    int ti = 0;
    int64_t toff = 0;  // where the next piece starts: tensor ti, element toff
    int64_t start = 0;
    for (int64_t piece_no = 0; piece_no == 0 || start < total; ++piece_no) {
      const int64_t piece = std::min(per_slot, total - start);
      if (!Piece(ctx, piece, piece_no, in, out, len, &ti, &toff, entered)) return;
      start += piece;
    }
  }

 private:
  // Publish the collective this rank entered: number + 1 and the signature text, the text first (a
  // reader that catches it half-written sees 0 or another number, and skips it).
  void Enter() {
    const Registered& g = *reg_;
    const int me = g.rank;
    const size_t k = std::min(text_.size(), size_t(g.layout[kTextMax]));
    g.word(me, kEntered)->store(0, std::memory_order_seq_cst);
    std::memcpy(g.bases[me] + g.layout[kEnteredText], text_.data(), k);
    g.word(me, kEnteredLen)->store(k, std::memory_order_seq_cst);
    g.word(me, kEntered)->store(seq_ + 1, std::memory_order_seq_cst);
  }

  // One generation: this piece of the inputs into my slot, every rank's slot summed into the outputs.
  bool Piece(OpKernelContext* ctx, int64_t piece, int64_t piece_no, const std::vector<const T*>& in,
             const std::vector<T*>& out, const std::vector<int64_t>& len, int* ti, int64_t* toff,
             Clock::time_point entered) {
    const Registered& g = *reg_;
    const int me = g.rank, size = g.size;
    const uint64_t gen = g.word(me, kReady)->load(std::memory_order_relaxed) + 1;
    // every peer has finished reading the slot I am about to write (two generations ago), or the whole
    // data area when my last generation used it
    const bool whole = g.word(me, kLastWhole)->load(std::memory_order_relaxed) != 0;
    const uint64_t floor = whole ? gen - 1 : (gen >= 2 ? gen - 2 : 0);
    for (int p = 0; p < size; ++p) {
      if (p != me && !Wait(ctx, g.word(p, kDone), floor, entered)) return false;
    }
    char* mine = g.slot(me, gen);
    {
      T* data = reinterpret_cast<T*>(mine + g.layout[kSlotDataAt]);
      int64_t k = 0, o = *toff;
      int i = *ti;
      while (k < piece) {
        const int64_t c = std::min(piece - k, len[i] - o);
        std::memcpy(data + k, in[i] + o, c * sizeof(T));
        k += c;
        o += c;
        if (o == len[i]) { ++i; o = 0; }
      }
    }
    const std::string text = text_ + ", piece " + std::to_string(piece_no);
    const uint64_t head[3] = {seq_, uint64_t(piece), std::min(uint64_t(text.size()), uint64_t(g.layout[kTextMax]))};
    std::memcpy(mine, head, sizeof(head));
    std::memcpy(mine + g.layout[kSlotTextAt], text.data(), head[2]);
    g.word(me, kLastWhole)->store(0, std::memory_order_relaxed);
    g.word(me, kReady)->store(gen, std::memory_order_seq_cst);  // publishes the slot (release and more)
    for (int p = 0; p < size; ++p) {
      if (p != me) g.ring(p);
    }
    for (int p = 0; p < size; ++p) {
      if (p != me && !Wait(ctx, g.word(p, kReady), gen, entered)) return false;
    }
    for (int p = 0; p < size; ++p) {
      const char* theirs = g.slot(p, gen);
      uint64_t th[3];
      std::memcpy(th, theirs, sizeof(th));
      if (th[0] != head[0] || th[1] != head[1] || th[2] != head[2] ||
          std::memcmp(theirs + g.layout[kSlotTextAt], text.data(), head[2]) != 0) {
        if (!CheckEntered(ctx)) return false;  // a peer in another collective: its entry names it
        const std::string seen(theirs + g.layout[kSlotTextAt],
                               std::min(th[2], uint64_t(g.layout[kTextMax])));
        return Mismatch(ctx, p, seen);
      }
    }
    std::vector<const T*> slots(size);
    for (int r = 0; r < size; ++r) slots[r] = reinterpret_cast<const T*>(g.slot(r, gen) + g.layout[kSlotDataAt]);
    Sum(slots, piece, out, len, ti, toff);
    g.word(me, kDone)->store(gen, std::memory_order_seq_cst);  // my reads of the peers' slots are over
    for (int p = 0; p < size; ++p) {
      if (p != me) g.ring(p);
    }
    return true;
  }

  // The piece's sum of every slot, in rank order (the Python path's one-round reduction), into the
  // outputs from tensor *ti, element *toff on; MEAN divides once at the end, as the Python path does.
  void Sum(const std::vector<const T*>& slots, int64_t piece, const std::vector<T*>& out,
           const std::vector<int64_t>& len, int* ti, int64_t* toff) {
    const int size = int(slots.size());
    const T divisor = T(size);
    int64_t k = 0;
    while (k < piece) {
      const int64_t c = std::min(piece - k, len[*ti] - *toff);
      T* dst = out[*ti] + *toff;
      const T* s0 = slots[0] + k;
      if (size == 2) {
        const T* s1 = slots[1] + k;
        if (mean_) {
          for (int64_t j = 0; j < c; ++j) dst[j] = (s0[j] + s1[j]) / divisor;
        } else {
          for (int64_t j = 0; j < c; ++j) dst[j] = s0[j] + s1[j];
        }
      } else {
        for (int64_t j = 0; j < c; ++j) dst[j] = s0[j];
        for (int r = 1; r < size; ++r) {
          const T* sr = slots[r] + k;
          for (int64_t j = 0; j < c; ++j) dst[j] += sr[j];
        }
        if (mean_) for (int64_t j = 0; j < c; ++j) dst[j] /= divisor;
      }
      k += c;
      *toff += c;
      if (*toff == len[*ti]) { ++*ti; *toff = 0; }
    }
  }

  bool Mismatch(OpKernelContext* ctx, int peer, const std::string& theirs) {
    reg_->word(reg_->rank, kState)->store(kMismatch, std::memory_order_release);
    ctx->SetStatus(errors::FailedPrecondition(
        "[tfcs-native:mismatch:", peer, "] rank ", reg_->rank, ": collective #", seq_, " mismatch: this rank "
        "called [", text_, "] but rank ", peer, " called [", theirs, "]"));
    return false;
  }

  // False (and the mismatch reported) when a peer entered this collective's number under another
  // signature: the ranks called different collectives.
  bool CheckEntered(OpKernelContext* ctx) {
    const Registered& g = *reg_;
    for (int p = 0; p < g.size; ++p) {
      if (p == g.rank || g.word(p, kEntered)->load(std::memory_order_seq_cst) != seq_ + 1) continue;
      const uint64_t k = std::min(g.word(p, kEnteredLen)->load(std::memory_order_seq_cst),
                                  uint64_t(g.layout[kTextMax]));
      const std::string theirs(g.bases[p] + g.layout[kEnteredText], k);
      if (g.word(p, kEntered)->load(std::memory_order_seq_cst) != seq_ + 1) continue;  // it moved on meanwhile
      if (theirs != text_.substr(0, size_t(g.layout[kTextMax]))) return Mismatch(ctx, p, theirs);
    }
    return true;
  }

  // The slow checks of a wait, every 50 ms: false (and the status set) when a peer died, a peer or this
  // rank stopped, the ranks are in different collectives, or the deadline passed.
  bool Healthy(OpKernelContext* ctx, Clock::time_point now, Clock::time_point entered, uint64_t target) {
    const Registered& g = *reg_;
    const int me = g.rank;
    for (int p = 0; p < g.size; ++p) {  // a dead process first: it is the cause, not the ranks it stopped
      if (p != me && !alive(g.pids[p])) {
        g.word(me, kState)->store(kPeerLost, std::memory_order_release);
        ctx->SetStatus(errors::Unavailable("[tfcs-native:peer_lost:", p, "] rank ", me, ": rank ", p,
                                           " (pid ", g.pids[p], ") died during the all-reduce"));
        return false;
      }
    }
    for (int p = 0; p < g.size; ++p) {
      const uint64_t st = g.word(p, kState)->load(std::memory_order_acquire);
      if (st == 0) continue;
      if (p == me) {  // this rank's process group failed (Python set the word): stop now
        ctx->SetStatus(errors::FailedPrecondition(
            st == kShutdown ? "[tfcs-native:shutdown] rank " : "[tfcs-native:failed] rank ", me,
            st == kShutdown ? ": the process group was shut down while this all-reduce waited"
                            : ": the process group failed while this all-reduce waited"));
      } else {
        ctx->SetStatus(errors::Aborted("[tfcs-native:aborted:", p, "] rank ", me, ": rank ", p, " ",
                                       StoppedBecause(st)));
      }
      return false;
    }
    if (!CheckEntered(ctx)) return false;
    if (std::chrono::duration<double>(now - entered).count() >= timeout_) {
      g.word(me, kState)->store(kTimeout, std::memory_order_release);
      ctx->SetStatus(errors::DeadlineExceeded(
          "[tfcs-native:timeout] rank ", me, ": collective #", seq_, " [", text_, "] did not complete within ",
          timeout_, " s (waiting for generation ", target, ")"));
      return false;
    }
    return true;
  }

  // Wait until *word >= target: spin (yielding) for spin_us_, then poll with short sleeps, longer as
  // the wait goes on (a rank far behind: evaluation, a checkpoint). False (and the status set) when
  // Healthy() says so. The deadline counts from `entered`, compared as a double, so any timeout, however
  // large, is a real one.
  bool Wait(OpKernelContext* ctx, std::atomic<uint64_t>* word, uint64_t target, Clock::time_point entered) {
    if (word->load(std::memory_order_acquire) >= target) return true;
    const auto start = Clock::now();
    struct Waited {  // however the wait ends, its time counts
      int64_t& total;
      Clock::time_point start;
      ~Waited() {
        total += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
      }
    } waited{waited_ns_, start};
    auto next_check = start;
    for (;;) {
      if (word->load(std::memory_order_acquire) >= target) return true;
      const auto now = Clock::now();
      const double waited_us = std::chrono::duration<double, std::micro>(now - start).count();
      if (waited_us < spin_us_) {
        sched_yield();
        continue;
      }
      if (now >= next_check) {
        next_check = now + std::chrono::milliseconds(50);
        if (!Healthy(ctx, now, entered, target)) return false;
      }
      struct timespec ts = {0, waited_us < 10000 ? 50000 : 1000000};
      nanosleep(&ts, nullptr);
    }
  }

  std::string segment_;                 // the attribute: the registered buffers' name
  std::shared_ptr<Registered> reg_;     // what the name was registered as (Attach)
  float timeout_ = 0;
  int spin_us_ = 0;
  bool mean_ = false;
  // the call in progress (calls are serialized by TurnMutex()): its number, signature, time waited
  uint64_t seq_ = 0;
  std::string text_;
  int64_t waited_ns_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("TfcsShmAllReduce").Device(DEVICE_CPU).TypeConstraint<float>("T"),
                        ShmAllReduceOp<float>);
REGISTER_KERNEL_BUILDER(Name("TfcsShmAllReduce").Device(DEVICE_CPU).TypeConstraint<double>("T"),
                        ShmAllReduceOp<double>);
