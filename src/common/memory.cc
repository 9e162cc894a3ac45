#include "common/memory.h"

#include <malloc.h>

namespace bragg {

void TuneAllocatorForBulkData() {
  ::mallopt(M_MMAP_THRESHOLD, 64 << 20);
  ::mallopt(M_TRIM_THRESHOLD, 128 << 20);
  ::mallopt(M_TOP_PAD, 16 << 20);
}

}  // namespace bragg
