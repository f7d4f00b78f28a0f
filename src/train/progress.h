// What a training run shows on stdout (Trainer::run(), TrainerOptions::progress):
// a bar rewritten in place with the estimated time left, a line every few
// steps, or nothing; and the short figures those lines use. Writes stdout
// only (flushed after each line); one thread, the trainer's.
#pragma once

#include <cstdint>
#include <string>

#include "train/trainer.h"

namespace strata::train {

class Progress {
 public:
  // kAuto: a bar when stdout is a terminal, lines otherwise.
  explicit Progress(ProgressMode mode);
  ProgressMode mode() const { return mode_; }
  // A line of its own (over the bar, which the next step redraws).
  void say(const std::string& line) const;
  // A step's line: the bar (with the estimated time left), or, in lines
  // mode, a line when `as_line` (every log_every steps, the first, the last).
  void step(const std::string& line, double eta_seconds, bool as_line) const;
  // Ends the bar's line.
  void end() const;

 private:
  ProgressMode mode_;
};

// "1.23G", "4.56M", "7.8k", "12".
std::string human_count(double v);
// "1h02m", "3m04s", "5s"; "?" for a negative, NaN or absurd value.
std::string human_seconds(double s);

}  // namespace strata::train
