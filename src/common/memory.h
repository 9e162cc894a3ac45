#pragma once

namespace bragg {

// Keeps freed heap memory for reuse instead of returning it to the kernel at once.
//
// glibc serves allocations over 128 KiB from fresh mmap()s and trims the heap top as soon as
// 128 KiB are free, so a program that moves MiB-sized messages (gRPC file transfers) pays
// page faults on every message: on virtual machines that is most of its CPU time. This raises
// the mmap threshold to 64 MiB and keeps up to 128 MiB of free heap. Call once, early in
// main(), in programs that move bulk data (pboxd, pbox, pbox-bench); libraries never call it.
void TuneAllocatorForBulkData();

}  // namespace bragg
