// The step attention's AVX2 task and split parts (cpu_attention_tasks.h says why a file of its own).

#include "cpu_attention_tasks.h"

namespace cpu_attention {

__attribute__((target("avx2,fma"))) CPU_ATTENTION_TASK(task_avx2, cpu_vec::v8sf, 8, 8, kFewRowsAvx2)
__attribute__((target("avx2,fma"))) CPU_ATTENTION_SPLIT(split_avx2, cpu_vec::v8sf, 8, kFewRowsAvx2)

}  // namespace cpu_attention
