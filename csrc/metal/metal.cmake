# Layout: Metal only (build).
# Metal backend (macOS): the kernels of metal/turboquant.metal reach the GPU in one of
# two forms, chosen by TURBOQUANT_METAL_LIBRARY (top-level CMakeLists.txt):
#   METALLIB: turboquant_mlx.metallib, built with MLX's mlx_build_metallib (flags:
#     -fno-fast-math, C++17 extensions allowed) and installed next to the extension
#     module, where eval_metal.cpp loads it. Needs Apple's Metal compiler
#     (`xcrun -sdk macosx metal`: Xcode plus, since Xcode 26, its Metal Toolchain
#     component; the Command Line Tools have none).
#   SOURCE: the Metal source, inlined into one text by embed_metal_source.py and
#     compiled into the extension as a C++ header (turboquant_metal_source.h: the entry
#     points of tq_entry.h and the headers it includes, without the instantiations);
#     eval_metal.cpp (-DTURBOQUANT_METAL_EMBEDDED) has MLX compile it plus one
#     instantiation at each kernel's first use.
#     Needs no Metal compiler at build time.
#   AUTO (default): METALLIB if the Metal compiler compiles and links a probe kernel
#     here, else SOURCE.
# Also adds the host code that dispatches the kernels. Included from the top-level
# CMakeLists.txt when MLX_BUILD_METAL is set; sets TURBOQUANT_METALLIB_FILE to the
# metallib to install (empty for SOURCE).
set(_tq_metal_dir ${CMAKE_CURRENT_LIST_DIR}/../../metal)

# Whether `xcrun -sdk macosx metal` compiles and links a kernel, as mlx_build_metallib
# will (a missing Xcode 26 Metal Toolchain fails here: its `metal` is a stub that
# exits with "cannot execute tool 'metal' due to missing Metal Toolchain").
# Sets ${ok_var} (TRUE/FALSE) and ${why_var} (what ran, or how it failed).
function(_tq_metal_compiler_works ok_var why_var)
  set(_dir ${CMAKE_CURRENT_BINARY_DIR}/metal_probe)
  file(REMOVE_RECURSE ${_dir})
  file(MAKE_DIRECTORY ${_dir})
  file(WRITE ${_dir}/probe.metal
       "#include <metal_stdlib>\n"
       "kernel void tq_probe(device float* x [[buffer(0)]],\n"
       "                     uint i [[thread_position_in_grid]]) { x[i] += 1.0f; }\n")
  set(_steps "compile;link")
  set(_compile_cmd xcrun -sdk macosx metal -fno-fast-math -c probe.metal -o probe.air)
  set(_link_cmd xcrun -sdk macosx metal probe.air -o probe.metallib)
  foreach(_step IN LISTS _steps)
    execute_process(
      COMMAND ${_${_step}_cmd}
      WORKING_DIRECTORY ${_dir}
      RESULT_VARIABLE _rc
      OUTPUT_VARIABLE _out
      ERROR_VARIABLE _err
      TIMEOUT 120)
    if(NOT _rc STREQUAL "0")
      string(STRIP "${_err}\n${_out}" _msg)
      string(REGEX REPLACE "\n.*" "" _msg "${_msg}") # the first line
      if(_msg STREQUAL "" AND _rc MATCHES "^[0-9]+$")
        set(_msg "exit status ${_rc}")
      elseif(_msg STREQUAL "")
        set(_msg "${_rc}") # xcrun did not run: "No such file or directory", a timeout
      endif()
      set(${ok_var} FALSE PARENT_SCOPE)
      set(${why_var} "`xcrun -sdk macosx metal` could not ${_step} a probe kernel: ${_msg}"
          PARENT_SCOPE)
      return()
    endif()
  endforeach()
  execute_process(
    COMMAND xcrun -sdk macosx -f metal
    OUTPUT_VARIABLE _path
    ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  set(${ok_var} TRUE PARENT_SCOPE)
  set(${why_var} "the Metal compiler works: ${_path}" PARENT_SCOPE)
endfunction()

string(TOUPPER "${TURBOQUANT_METAL_LIBRARY}" _tq_metal_library)
if(_tq_metal_library STREQUAL "SOURCE")
  set(_tq_metal_kind SOURCE)
  set(_tq_metal_why "TURBOQUANT_METAL_LIBRARY=SOURCE")
elseif(_tq_metal_library STREQUAL "METALLIB" OR _tq_metal_library STREQUAL "AUTO")
  _tq_metal_compiler_works(_tq_metal_ok _tq_metal_why)
  if(_tq_metal_ok)
    set(_tq_metal_kind METALLIB)
  elseif(_tq_metal_library STREQUAL "AUTO")
    set(_tq_metal_kind SOURCE)
  else()
    message(
      FATAL_ERROR
        "turboquant_mlx: TURBOQUANT_METAL_LIBRARY=METALLIB, but ${_tq_metal_why}.\n"
        "Install Xcode and its Metal Toolchain (xcodebuild -downloadComponent MetalToolchain), "
        "or configure with -DTURBOQUANT_METAL_LIBRARY=SOURCE (or AUTO) to compile the "
        "kernels from source at run time.")
  endif()
else()
  message(FATAL_ERROR "turboquant_mlx: TURBOQUANT_METAL_LIBRARY=${TURBOQUANT_METAL_LIBRARY}: "
                      "expected AUTO, METALLIB or SOURCE")
endif()

if(_tq_metal_kind STREQUAL "METALLIB")
  message(STATUS "turboquant_mlx Metal kernels: metallib (turboquant_mlx.metallib, "
                 "precompiled: TURBOQUANT_METAL_LIBRARY=${_tq_metal_library}, ${_tq_metal_why})")
  mlx_build_metallib(
    TARGET turboquant_metallib
    TITLE turboquant_mlx
    SOURCES ${_tq_metal_dir}/turboquant.metal
    INCLUDE_DIRS ${_tq_metal_dir} ${CMAKE_CURRENT_LIST_DIR}/..
    DEPS ${_tq_metal_dir}/tq_kernels.h ${_tq_metal_dir}/tq_attention_simd.h
         ${_tq_metal_dir}/tq_portable.h ${_tq_metal_dir}/tq_params.h
    OUTPUT_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
  add_dependencies(turboquant_core turboquant_metallib)
  set(TURBOQUANT_METALLIB_FILE ${CMAKE_CURRENT_BINARY_DIR}/turboquant_mlx.metallib)
else()
  if(_tq_metal_library STREQUAL "AUTO")
    set(_tq_metal_why "TURBOQUANT_METAL_LIBRARY=AUTO, and ${_tq_metal_why}")
  endif()
  message(STATUS "turboquant_mlx Metal kernels: source (embedded, compiled by MLX "
                 "at first use: ${_tq_metal_why})")
  set(_tq_metal_header ${CMAKE_CURRENT_BINARY_DIR}/turboquant_metal_source.h)
  file(GLOB _tq_metal_sources CONFIGURE_DEPENDS ${_tq_metal_dir}/*.metal ${_tq_metal_dir}/*.h)
  add_custom_command(
    OUTPUT ${_tq_metal_header}
    COMMAND
      ${Python_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/embed_metal_source.py
      ${_tq_metal_dir}/tq_entry.h -I ${_tq_metal_dir} -I ${CMAKE_CURRENT_LIST_DIR}/..
      --header ${_tq_metal_header} --depfile ${_tq_metal_header}.d
    DEPENDS ${CMAKE_CURRENT_LIST_DIR}/embed_metal_source.py ${_tq_metal_sources}
    DEPFILE ${_tq_metal_header}.d
    COMMENT "Embedding the Metal source in turboquant_metal_source.h"
    VERBATIM)
  add_custom_target(turboquant_metal_source DEPENDS ${_tq_metal_header})
  add_dependencies(turboquant_core turboquant_metal_source)
  target_include_directories(turboquant_core PRIVATE ${CMAKE_CURRENT_BINARY_DIR})
  target_compile_definitions(turboquant_core PRIVATE TURBOQUANT_METAL_EMBEDDED)
  set(TURBOQUANT_METALLIB_FILE "")
endif()

target_sources(turboquant_core PRIVATE ${CMAKE_CURRENT_LIST_DIR}/eval_metal.cpp)
target_include_directories(turboquant_core PRIVATE ${_tq_metal_dir} ${MLX_INCLUDE_DIRS})
