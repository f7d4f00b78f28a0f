// What `strata finetune` and `strata demo` share: Ctrl-C handling and the
// exit code of a trainer error.
#pragma once

#include <atomic>
#include <functional>

#include "common/status.h"

namespace strata::tools {

// While alive, SIGINT, SIGTERM, SIGHUP and SIGXCPU (the soft CPU-time limit)
// set a flag instead of killing the process (the trainer finishes its step,
// saves a checkpoint and returns); a second signal (not SIGXCPU's repeats)
// gets the default action, so a stuck job can still be killed. Restores the previous
// handlers on destruction. One instance at a time per process.
class StopSignals {
 public:
  // `message`: written to stderr at the first signal (a string literal).
  explicit StopSignals(const char* message = kFinetuneStopMessage);
  static constexpr const char* kFinetuneStopMessage =
      "\nstopping after this step (a checkpoint is saved, also after the last step); signal again to abort now\n";
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  const std::atomic<bool>* flag() const;
  bool stopped() const;
  int signal_number() const;  // the first signal received (0: none)
};

// Exit code 130 (128 + SIGINT, the shell's convention) after a Ctrl-C that
// was handled cleanly; 1 for errors the user can fix; 2 for kInternal.
inline constexpr int kExitInterrupted = 130;
int exit_code_for(const Status& st);

}  // namespace strata::tools
