# Finds LibTorch from the torch wheel (scripts/setup.sh puts it in .venv) and
# works around what its CMake config expects of the machine.
#
# Trap 2: no -fopenmp anywhere; the wheel brings its own OpenMP runtime.
# Trap 3: the proto/gRPC targets never see torch's include directories; torch
# is only linked by core (and what links core), see refit_torch_link().
if(NOT Torch_DIR AND NOT DEFINED ENV{Torch_DIR})
  foreach(py ${CMAKE_SOURCE_DIR}/.venv/bin/python3 python3)
    execute_process(
      COMMAND ${py} -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
      OUTPUT_VARIABLE _torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE _torch_rc ERROR_QUIET)
    if(_torch_rc EQUAL 0 AND _torch_prefix)
      list(APPEND CMAKE_PREFIX_PATH ${_torch_prefix})
      execute_process(
        COMMAND ${py} -c "import os, nvidia; print(os.path.dirname(nvidia.__path__[0]))"
        OUTPUT_VARIABLE _site OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
      break()
    endif()
  endforeach()
endif()

# Torch's config looks for the CUDA toolkit; point it at the system one.
if(NOT DEFINED CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
  set(CUDAToolkit_ROOT /usr/local/cuda)
endif()
if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
  set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
endif()
# The wheel carries cuDNN in site-packages/nvidia/cudnn; Caffe2 may ask.
if(_site AND EXISTS ${_site}/nvidia/cudnn)
  set(CUDNN_ROOT ${_site}/nvidia/cudnn CACHE PATH "")
  set(CUDNN_INCLUDE_PATH ${_site}/nvidia/cudnn/include CACHE PATH "")
endif()
set(CAFFE2_USE_CUDNN OFF CACHE BOOL "")
find_package(Torch REQUIRED)
# TORCH_CXX_FLAGS carries only the ABI flag; never -fopenmp.
string(REPLACE "-fopenmp" "" TORCH_CXX_FLAGS "${TORCH_CXX_FLAGS}")
get_filename_component(REFIT_TORCH_LIB_DIR "${TORCH_LIBRARY}" DIRECTORY)
message(STATUS "LibTorch ${Torch_VERSION} from ${REFIT_TORCH_LIB_DIR}")
