#pragma once

// System calls made directly, for pbox-init's processes that must not touch libc state: the
// PID namespace holder shares pbox-init's memory and thread-local storage (CLONE_VM), where a
// glibc wrapper would store errno under pbox-init's feet. RawSyscall returns the kernel's
// result: -errno on failure. No allocation, no errno, async-signal-safe.

namespace bragg::pbox {

#if defined(__x86_64__)
inline long RawSyscall(long n, long a = 0, long b = 0, long c = 0, long d = 0, long e = 0) {
  long ret;
  register long r10 __asm__("r10") = d;
  register long r8 __asm__("r8") = e;
  __asm__ volatile("syscall"
                   : "=a"(ret)
                   : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8)
                   : "rcx", "r11", "memory");
  return ret;
}
#elif defined(__aarch64__)
inline long RawSyscall(long n, long a = 0, long b = 0, long c = 0, long d = 0, long e = 0) {
  register long x8 __asm__("x8") = n;
  register long x0 __asm__("x0") = a;
  register long x1 __asm__("x1") = b;
  register long x2 __asm__("x2") = c;
  register long x3 __asm__("x3") = d;
  register long x4 __asm__("x4") = e;
  __asm__ volatile("svc 0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4) : "memory");
  return x0;
}
#else
#error "pbox-init needs raw system calls for this architecture"
#endif

}  // namespace bragg::pbox
