/* The harnesses' input file: arrays read one after another, each owned
 * until the process ends (a harness is one launch, then exits). */
#ifndef HE_TWIN_INPUT_H
#define HE_TWIN_INPUT_H

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

struct he_twin_input {
    FILE *f;
    const char *name; /* the harness's, for its message */
    std::vector<std::unique_ptr<char[]>> owned;

    template <typename T>
    T *read(size_t count)
    {
        owned.push_back(std::make_unique<char[]>(count * sizeof(T) + 1));
        if (count && std::fread(owned.back().get(), sizeof(T), count, f) != count) {
            std::fprintf(stderr, "%s: the input file ends early\n", name);
            std::exit(2);
        }
        return reinterpret_cast<T *>(owned.back().get());
    }
};

#endif
