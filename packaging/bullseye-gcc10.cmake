# CMake toolchain for release wheels: Debian bullseye's gcc 10 with bullseye as the sysroot
# (glibc 2.31, libstdc++ of gcc 10), so what is built runs on glibc 2.31 and newer and auditwheel
# can tag it manylinux_2_31. DDIP_SYSROOT is a root made by packaging/debian_root.py (g++ and
# libssl-dev in it); packaging/build_wheels.py sets it.
if(NOT DEFINED ENV{DDIP_SYSROOT} OR NOT EXISTS "$ENV{DDIP_SYSROOT}/usr/bin/g++-10")
  message(FATAL_ERROR " DDIP_SYSROOT must name a Debian bullseye root with g++-10 in it (packaging/build_wheels.py makes one)")
endif()
set(CMAKE_SYSROOT "$ENV{DDIP_SYSROOT}")
set(CMAKE_CXX_COMPILER "${CMAKE_SYSROOT}/usr/bin/g++-10")
# This machine's binutils archive, assemble and link (gcc 10 finds `as` and `ld` on PATH): the
# sysroot's own are linked against bullseye's libraries, which this machine does not have.
find_program(CMAKE_AR ar NO_CMAKE_FIND_ROOT_PATH REQUIRED)
find_program(CMAKE_RANLIB ranlib NO_CMAKE_FIND_ROOT_PATH REQUIRED)
