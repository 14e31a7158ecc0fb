// One POSIX shared-memory segment, mapped into this process.
#pragma once

#include <cstddef>
#include <string>

namespace dpp {

class SharedSegment {
 public:
  // Creates `name` exclusively (O_EXCL, mode 0600) with `bytes` bytes, zero-filled.
  static SharedSegment create(const std::string& name, size_t bytes);
  // Maps an existing segment created by another process.
  static SharedSegment attach(const std::string& name);

  SharedSegment() = default;
  SharedSegment(SharedSegment&& other) noexcept;
  SharedSegment& operator=(SharedSegment&& other) noexcept;
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;
  ~SharedSegment();

  // Removes the name from /dev/shm; the mapping stays valid. Idempotent.
  void unlink();

  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  SharedSegment(std::string name, void* data, size_t size, bool linked);
  void release() noexcept;

  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool linked_ = false;
};

}  // namespace dpp
