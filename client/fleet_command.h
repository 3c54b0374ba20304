// `refitctl fleet status|push|reload`: the fleet coordinator's command line
// (client/fleet_coordinator.h, docs/fleet.md).
#ifndef REFIT_CLIENT_FLEET_COMMAND_H_
#define REFIT_CLIENT_FLEET_COMMAND_H_

namespace refit::client {

// argv[0] is "fleet". Returns refitctl's exit code: 0; 1 usage; 5 ABORTED
// (another fleet refit runs, a prepare failed: nobody committed); 7 etcd
// unreachable, or the fleet committed but a member did not confirm its
// commit; the others as for every refitctl command.
int RunFleetCommand(int argc, char** argv);

}  // namespace refit::client

#endif  // REFIT_CLIENT_FLEET_COMMAND_H_
