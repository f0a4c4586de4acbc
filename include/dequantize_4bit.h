/* Parameter block of cuda/dequantize_4bit.cu: bitsandbytes' 4-bit weights (NF4, FP4, any 16-entry code,
 * with or without nested scales) to a dense dtype, up to DEQUANTIZE_4BIT_PARTS weights in one launch, one
 * after another in the output (q, k and v of one fused node). */
#pragma once
#include "bastile.h"

#define DEQUANTIZE_4BIT_BLOCK 256
#define DEQUANTIZE_4BIT_PARTS 3
/* Units (8 elements, or 1 for `scalar`) a thread loads before it stores any. */
#define DEQUANTIZE_4BIT_UNITS 4

/* dequantize_4bit_<dtype>_<vec|scalar>: `vec` units are 8 elements (4 packed bytes). */
#define DEQUANTIZE_4BIT_KERNELS(K) \
  K(f32, vec) K(f32, scalar) K(f16, vec) K(f16, scalar) K(bf16, vec) K(bf16, scalar)

/* One weight as bitsandbytes stores it (Params4bit and its QuantState). */
typedef struct Quantized4bit {
  const uint8_t *packed;      /* [ceil(n / 2)]: element 2i in the high nibble of byte i, 2i + 1 in the low */
  const void *absmax;         /* [ceil(n / blocksize)]: f32 scales, or u8 codes of nested_code when nested */
  const float *code;          /* [16]: the value of each 4-bit code */
  const float *nested_absmax; /* [ceil(blocks / nested_blocksize)], or NULL: absmax holds f32 scales */
  const float *nested_code;   /* [256] */
  const float *offset;        /* [1]: added to each nested scale */
  int64_t n;                  /* elements */
  int64_t blocksize;          /* elements per scale */
  int64_t nested_blocksize;   /* scales per nested scale */
} Quantized4bit;

typedef struct Dequantize4bit {
  Quantized4bit parts[DEQUANTIZE_4BIT_PARTS];
  void *out;     /* [sum of n]: the parts' elements one after another */
  int32_t count; /* parts used */
  int32_t dtype; /* of out: f32, f16 or bf16 */
} Dequantize4bit;
