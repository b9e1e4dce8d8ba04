# Layout: Metal only (build).
# Metal backend (macOS): builds turboquant_mlx.metallib from metal/turboquant.metal
# with MLX's mlx_build_metallib (flags: -fno-fast-math, C++17 extensions allowed) and
# adds the host code that dispatches its kernels. Included from the top-level
# CMakeLists.txt when MLX_BUILD_METAL is set; the metallib is installed next to the
# extension module, where eval_metal.cpp looks for it.
set(_tq_metal_dir ${CMAKE_CURRENT_LIST_DIR}/../../metal)
mlx_build_metallib(
  TARGET turboquant_metallib
  TITLE turboquant_mlx
  SOURCES ${_tq_metal_dir}/turboquant.metal
  INCLUDE_DIRS ${_tq_metal_dir} ${CMAKE_CURRENT_LIST_DIR}/..
  DEPS ${_tq_metal_dir}/tq_kernels.h ${_tq_metal_dir}/tq_attention_simd.h
       ${_tq_metal_dir}/tq_portable.h ${_tq_metal_dir}/tq_params.h
  OUTPUT_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
add_dependencies(turboquant_core turboquant_metallib)

target_sources(turboquant_core PRIVATE ${CMAKE_CURRENT_LIST_DIR}/eval_metal.cpp)
target_include_directories(turboquant_core PRIVATE ${_tq_metal_dir} ${MLX_INCLUDE_DIRS})
