// torch.ops.bastile.dequantize_4bit: bitsandbytes' 4-bit weights (Params4bit data and its QuantState) to a
// dense [sum of rows, cols] tensor of `dtype`, bit for bit bitsandbytes' dequantize_4bit of each, one after
// another (cuda/dequantize_4bit.cu). Up to three weights take one launch. Frozen weights: no autograd node.
#include <numeric>

#include "op.h"

namespace bastile {
namespace {

using Optionals = c10::List<std::optional<at::Tensor>>;

struct Dequantize4bitOp {
  static constexpr const char* schema =
      "dequantize_4bit(Tensor[] packed, Tensor[] absmax, Tensor[] code, int[] blocksize, SymInt[] rows, SymInt cols, "
      "ScalarType dtype, Tensor?[] nested_absmax, Tensor?[] nested_code, int[] nested_blocksize, Tensor?[] offset) "
      "-> Tensor";

  static at::Tensor kernel(at::TensorList packed, at::TensorList absmax, at::TensorList code,
                           c10::IntArrayRef blocksize, c10::SymIntArrayRef rows, const c10::SymInt& cols, at::ScalarType dtype,
                           const Optionals& nested_absmax, const Optionals& nested_code,
                           c10::IntArrayRef nested_blocksize, const Optionals& offset) {
    constexpr const char* op = "dequantize_4bit";
    const size_t count = packed.size();
    TORCH_CHECK(count >= 1 && count <= DEQUANTIZE_4BIT_PARTS, "bastile.", op, ": takes 1 to ",
                DEQUANTIZE_4BIT_PARTS, " weights, got ", count);
    for (const auto& [name, size] :
         {std::pair{"absmax", absmax.size()}, {"code", code.size()}, {"blocksize", blocksize.size()},
          {"rows", rows.size()}, {"nested_absmax", nested_absmax.size()}, {"nested_code", nested_code.size()},
          {"nested_blocksize", nested_blocksize.size()}, {"offset", offset.size()}})
      TORCH_CHECK(size == count, "bastile.", op, ": ", name, " must have one entry per weight (", count, "), got ",
                  size);
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, "bastile.", op,
                ": dtype must be float32, float16 or bfloat16, got ", dtype);
    TORCH_CHECK(cols >= 0, "bastile.", op, ": cols must be >= 0, got ", cols);

    Dequantize4bit p{.count = static_cast<int32_t>(count)};
    std::vector<at::Tensor> keep;  // contiguous copies, alive until the launch is queued
    const auto& device = packed[0].device();
    // Checks t and returns its data (null for Meta tensors).
    const auto tensor = [&](std::string name, size_t i, const at::Tensor& t, at::ScalarType type,
                            const c10::SymInt& numel) {
      name += "[" + std::to_string(i) + "]";
      TORCH_CHECK(t.scalar_type() == type, "bastile.", op, ": ", name, " must be ", type, ", got ", t.scalar_type());
      TORCH_CHECK(t.sym_numel() == numel, "bastile.", op, ": ", name, " must have ", numel, " elements, got ",
                  t.sym_numel());
      TORCH_CHECK(t.device() == device, "bastile.", op, ": packed[0] is on ", device, " but ", name, " is on ",
                  t.device());
      const auto& c = keep.emplace_back(t.contiguous());
      return c.is_meta() ? nullptr : c.data_ptr();
    };
    for (size_t i = 0; i < count; ++i) {
      TORCH_CHECK(rows[i] >= 0 && blocksize[i] > 0, "bastile.", op, ": rows[", i, "] must be >= 0 and blocksize[", i,
                  "] > 0, got ", rows[i], " and ", blocksize[i]);
      const c10::SymInt n = rows[i] * cols, blocks = (n + blocksize[i] - 1) / blocksize[i];
      auto& q = p.parts[i];
      q = {.n = n.maybe_as_int().value_or(0), .blocksize = blocksize[i]};  // symbolic only on Meta: no launch
      q.packed = static_cast<const uint8_t*>(tensor("packed", i, packed[i], at::kByte, (n + 1) / 2));
      q.code = static_cast<const float*>(tensor("code", i, code[i], at::kFloat, 16));
      const bool nested = nested_absmax.get(i).has_value();
      TORCH_CHECK(nested_code.get(i).has_value() == nested && offset.get(i).has_value() == nested, "bastile.", op,
                  ": nested_absmax[", i, "], nested_code[", i, "] and offset[", i, "] are given together or not at all");
      q.absmax = tensor("absmax", i, absmax[i], nested ? at::kByte : at::kFloat, blocks);
      if (!nested) continue;
      TORCH_CHECK(nested_blocksize[i] > 0, "bastile.", op, ": nested_blocksize[", i, "] must be > 0, got ",
                  nested_blocksize[i]);
      q.nested_blocksize = nested_blocksize[i];
      const c10::SymInt nested_blocks = (blocks + nested_blocksize[i] - 1) / nested_blocksize[i];
      q.nested_absmax = static_cast<const float*>(tensor("nested_absmax", i, *nested_absmax.get(i), at::kFloat, nested_blocks));
      q.nested_code = static_cast<const float*>(tensor("nested_code", i, *nested_code.get(i), at::kFloat, 256));
      q.offset = static_cast<const float*>(tensor("offset", i, *offset.get(i), at::kFloat, 1));
    }
    const c10::SymInt total = std::accumulate(rows.begin(), rows.end(), c10::SymInt(0));
    auto out = at::empty_symint({total, cols}, packed[0].options().dtype(dtype));
    if (out.is_meta() || out.numel() == 0) return out;
    p.out = out.data_ptr();
    p.dtype = dtype_code(op, {"out", out});
    launch(out, p);
    return out;
  }
};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::Dequantize4bitOp)
