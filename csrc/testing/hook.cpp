#include "testing/hook.h"

#include <mutex>

namespace kda {
namespace {

std::mutex forced_mutex;
Forced forced_settings;

}  // namespace

Forced forced() {
  std::lock_guard<std::mutex> lock(forced_mutex);
  return forced_settings;
}

void change_forced(const std::function<void(Forced&)>& change) {
  std::lock_guard<std::mutex> lock(forced_mutex);
  change(forced_settings);
}

}  // namespace kda
