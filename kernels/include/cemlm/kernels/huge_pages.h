// Large buffers on transparent huge pages (2 MiB) where the kernel allows them: a decode step
// reads the KV cache and the weights in 16–128 KiB runs scattered over gigabytes, so with 4 KiB
// pages nearly every run starts with a TLB miss. Debian's default THP policy ("madvise") grants
// huge pages only to regions that ask, which this allocator does for allocations of 2 MiB and up;
// smaller ones, and kernels that refuse, get ordinary pages. Contents are untouched.
#pragma once
#include <sys/mman.h>

#include <cstddef>
#include <cstdlib>
#include <new>
#include <vector>

namespace cemlm {

constexpr size_t kHugePageBytes = size_t(2) << 20;

template <typename T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) {}

  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePageBytes) return static_cast<T*>(::operator new(bytes));
    const size_t rounded = (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
    void* p = std::aligned_alloc(kHugePageBytes, rounded);
    if (!p) throw std::bad_alloc();
    madvise(p, rounded, MADV_HUGEPAGE);  // advice only: failure leaves ordinary pages
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) {
    if (n * sizeof(T) < kHugePageBytes)
      ::operator delete(p);
    else
      std::free(p);
  }
  template <typename U>
  bool operator==(const HugePageAllocator<U>&) const { return true; }
};

template <typename T>
using HugePageVector = std::vector<T, HugePageAllocator<T>>;

}  // namespace cemlm
