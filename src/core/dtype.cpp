// Name lookup generated from the dtype list.
#include "core/dtype.h"

namespace nb {

bool dtype_from_name(std::string_view name, DType* out) {
#define NB_X(e, bits, n, st) \
  if (name == (n)) {         \
    *out = DType::e;         \
    return true;             \
  }
  NB_DTYPES(NB_X)
#undef NB_X
  return false;
}

}  // namespace nb
