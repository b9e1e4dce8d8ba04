// Stub of the macOS SDK header, for tools/check_metal_host.sh only: the Objective-C
// runtime types and functions metal-cpp's inline code calls.
#pragma once

typedef struct objc_class* Class;
struct objc_object {
  Class isa;
};
typedef struct objc_selector* SEL;

extern "C" Class objc_lookUpClass(const char* name);
