"""The primitives that act entry by entry: each output entry is computed from the operands' entries
at the same index (an operand of lower rank, a scalar, is broadcast). Shared by the analyses that
follow an axis through a program (the per-example proof, the layout of a shard_map body's values).
"""

__all__ = ["ELEMENTWISE"]

ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem", "and", "or", "xor", "not",
    "eq", "ne", "lt", "le", "gt", "ge", "neg", "exp", "exp2", "log", "log1p", "expm1", "tanh",
    "logistic", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh",
    "atanh", "sqrt", "rsqrt", "cbrt", "abs", "sign", "floor", "ceil", "round", "is_finite",
    "select_n", "clamp", "convert_element_type", "integer_pow", "square", "erf", "erfc", "erf_inv",
    "lgamma", "digamma", "reduce_precision", "nextafter", "copy", "copy_p", "stop_gradient", "real",
    "imag", "conj", "complex", "add_any", "shift_left", "shift_right_logical",
    "shift_right_arithmetic", "population_count", "optimization_barrier", "jaxtrace_tag",
})
