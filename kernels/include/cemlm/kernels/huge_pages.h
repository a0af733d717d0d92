// Large buffers on transparent huge pages (2 MiB) where the kernel allows them: a decode step
// reads the KV cache and the weights in 16–128 KiB runs scattered over gigabytes, so with 4 KiB
// pages nearly every run starts with a TLB miss. Debian's default THP policy ("madvise") grants
// huge pages only to regions that ask, which this allocator does for allocations of 2 MiB and up;
// smaller ones, and kernels that refuse, get ordinary pages. Contents are untouched.
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
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

// Gives the whole pages inside [p, p + bytes) back to the kernel (MADV_DONTNEED): for memory that
// will not be read again, such as a weight whose packed copy is all that is used, or a file
// mapping already copied out. Reading them afterwards gives zeros in private anonymous memory
// (not the old contents) and the file's bytes again in a file mapping.
inline void release_pages(void* p, size_t bytes) {
  static const uintptr_t kPage = uintptr_t(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kPage - 1) & ~(kPage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kPage - 1);
  if (end <= begin) return;
  // Not a huge-page candidate any more: khugepaged fills a 2 MiB range with zero pages around the
  // few it finds present there, which would bring released memory back.
  madvise(reinterpret_cast<void*>(begin), end - begin, MADV_NOHUGEPAGE);
  madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

}  // namespace cemlm
