// One way the kernels share work among torch's threads.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <atomic>
#include <cstdint>

namespace cenote {

// Calls worker(next) on every thread; next() hands out 0, 1, ..., n - 1, then -1, so each thread
// takes the next task when it is free.
template <typename F>
inline void share_tasks(int64_t n, F&& worker) {
  std::atomic<int64_t> counter{0};
  auto next = [&]() -> int64_t {
    const int64_t i = counter++;
    return i < n ? i : -1;
  };
  const at::ThreadLocalState caller;  // inference mode, grad mode, ... of the calling thread
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    at::ThreadLocalStateGuard same_state(caller);
    worker(next);
  });
}

}  // namespace cenote
