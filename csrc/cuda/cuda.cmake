# Layout: CUDA only (build).
# CUDA backend: kernels (metal/tq_kernels.h, compiled by nvcc through the entry points
# in this folder) launched through MLX's CUDA command encoder. Included from the
# top-level CMakeLists.txt when TURBOQUANT_BUILD_CUDA is ON; needs an MLX build with
# CUDA (e.g. -DMLX_DIR=<site-packages>/mlx/share/cmake/MLX of the mlx-cuda wheel).
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

set(CMAKE_CUDA_STANDARD 20) # MLX's headers need C++20
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
if(NOT DEFINED TURBOQUANT_CUDA_ARCHITECTURES)
  # Ampere (A100) and Hopper (H100/H200) machine code; newer GPUs JIT the sm_90 PTX.
  set(TURBOQUANT_CUDA_ARCHITECTURES "80-real;90")
endif()

set(_tq_cuda_sources
    ${CMAKE_CURRENT_LIST_DIR}/eval_cuda.cu
    ${CMAKE_CURRENT_LIST_DIR}/attention_f32_lo.cu
    ${CMAKE_CURRENT_LIST_DIR}/attention_f32_hi.cu
    ${CMAKE_CURRENT_LIST_DIR}/attention_f16_lo.cu
    ${CMAKE_CURRENT_LIST_DIR}/attention_f16_hi.cu
    ${CMAKE_CURRENT_LIST_DIR}/attention_bf16_lo.cu
    ${CMAKE_CURRENT_LIST_DIR}/attention_bf16_hi.cu
    ${CMAKE_CURRENT_LIST_DIR}/attention_mma_d64.cu
    ${CMAKE_CURRENT_LIST_DIR}/attention_mma_d128.cu
    ${CMAKE_CURRENT_LIST_DIR}/attention_mma_d256.cu
    ${CMAKE_CURRENT_LIST_DIR}/attention_simd_d64.cu
    ${CMAKE_CURRENT_LIST_DIR}/attention_simd_d128.cu
    ${CMAKE_CURRENT_LIST_DIR}/attention_simd_d256.cu
    ${CMAKE_CURRENT_LIST_DIR}/simdgroup_matrix_check.cu
    ${CMAKE_CURRENT_LIST_DIR}/kernels_misc.cu)
target_sources(turboquant_core PRIVATE ${_tq_cuda_sources})
# Tuning builds: definitions for the tensor-core kernel's shape (see attention_mma.cuh),
# applied only to the sources that include it, so that changing them rebuilds those.
set(TURBOQUANT_MMA_TUNE "" CACHE STRING "definitions for the tensor-core kernel's shape")
if(TURBOQUANT_MMA_TUNE)
  set_source_files_properties(
    ${CMAKE_CURRENT_LIST_DIR}/eval_cuda.cu ${CMAKE_CURRENT_LIST_DIR}/attention_mma_d64.cu
    ${CMAKE_CURRENT_LIST_DIR}/attention_mma_d128.cu ${CMAKE_CURRENT_LIST_DIR}/attention_mma_d256.cu
    PROPERTIES COMPILE_DEFINITIONS "${TURBOQUANT_MMA_TUNE}")
endif()
set_source_files_properties(${_tq_cuda_sources} PROPERTIES LANGUAGE CUDA)
set_target_properties(turboquant_core PROPERTIES
  CUDA_ARCHITECTURES "${TURBOQUANT_CUDA_ARCHITECTURES}"
  CUDA_SEPARABLE_COMPILATION OFF)
# compat/ supplies <fmt/format.h>, which MLX's CUDA headers include but the wheel lacks.
target_include_directories(turboquant_core PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}
  ${CMAKE_CURRENT_LIST_DIR}/../../metal
  ${CMAKE_CURRENT_LIST_DIR}/compat)
# No fast math: the quantizer must round exactly like the CPU backend.
target_compile_options(turboquant_core PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo -diag-suppress=997,20012>)
target_link_libraries(turboquant_core PUBLIC CUDA::cudart_static)
