// refitctl: see client/refitctl.h and `refitctl --help`.
#include "client/refitctl.h"

int main(int argc, char** argv) { return refit::client::RunRefitctl(argc, argv); }
