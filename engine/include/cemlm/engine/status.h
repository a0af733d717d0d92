// Status helpers for the edges (config, checkpoint, requests): early return on error.
#pragma once
#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define CEMLM_RETURN_IF_ERROR(expr) \
  do {                              \
    auto _st = (expr);              \
    if (!_st.ok()) return _st;      \
  } while (0)

#define CEMLM_CONCAT_INNER(a, b) a##b
#define CEMLM_CONCAT(a, b) CEMLM_CONCAT_INNER(a, b)
#define CEMLM_ASSIGN_OR_RETURN(lhs, expr) \
  CEMLM_ASSIGN_OR_RETURN_IMPL(CEMLM_CONCAT(_sor_, __LINE__), lhs, expr)
#define CEMLM_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(*tmp)
