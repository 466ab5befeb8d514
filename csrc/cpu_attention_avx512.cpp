// The step attention's AVX-512 task (cpu_attention_tasks.h says why a file of its own).

#include "cpu_attention_tasks.h"

namespace cpu_attention {

__attribute__((target("avx512f,fma"))) CPU_ATTENTION_TASK(task_avx512, cpu_vec::v16sf, 8, 16, kFewRowsAvx512)

}  // namespace cpu_attention
