// Activations applied by GEMM/GEMV epilogues (on the fp32 accumulator).
#pragma once
__device__ __forceinline__ float fc_act_none(float v) { return v; }
__device__ __forceinline__ float fc_act_relu(float v) { return fc_max(v, 0.0f); }
__device__ __forceinline__ float fc_act_gelu(float v) { return fc_gelu_erf(v); }
__device__ __forceinline__ float fc_act_gelu_tanh(float v) { return fc_gelu_tanh(v); }
__device__ __forceinline__ float fc_act_silu(float v) { return v * fc_sigmoid(v); }
