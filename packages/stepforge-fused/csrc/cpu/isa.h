// SPDX-License-Identifier: Apache-2.0
// CPU kernel path selection and threading defaults (isa.cpp).
#pragma once

#include <string>
#include <vector>

namespace stepforge::cpu {

struct KernelTable;

// ISA selection.
std::string active_isa();
std::vector<std::string> supported_isas();
std::vector<std::string> compiled_isas();
void set_isa(const std::string& name);  // throws std::invalid_argument
std::string env_isa();                   // value of STEPFORGE_CPU_ISA at import ("" if unset)
bool has_openmp();
int max_threads();
int default_threads();
void set_default_threads(int n);
bool cpu_has(const char* feature);

// The kernels of the active path, and the thread count a call with ctx uses (ctx <= 0: the default).
const KernelTable& active_table();
int resolve_threads(int ctx);

}  // namespace stepforge::cpu
