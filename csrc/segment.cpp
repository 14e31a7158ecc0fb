#include "segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "errors.h"

namespace dpp {

namespace {

// Closes a file descriptor when it goes out of scope.
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

void check_name(const std::string& name) {
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos ||
      name.size() > 200) {
    throw TransportFailure("invalid shared-memory segment name '" + name +
                           "': must be '/' followed by up to 199 characters without '/'");
  }
}

void* map_shared(int fd, size_t bytes, const std::string& name) {
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) throw_errno("mmap of shared-memory segment " + name);
  return data;
}

// Reserves the segment's pages now: ftruncate leaves it sparse, and a /dev/shm too small
// for it would otherwise show only at the first write to a missing page, as SIGBUS.
void reserve_pages(int fd, size_t bytes, const std::string& name) {
  struct statvfs filesystem;
  const bool known = ::fstatvfs(fd, &filesystem) == 0;
  const int err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err == 0 || err == EOPNOTSUPP || err == EINVAL) return;  // EOPNOTSUPP: cannot reserve
  ::shm_unlink(name.c_str());
  std::string free_space = "an unknown amount";
  if (known) {
    free_space = std::to_string(static_cast<unsigned long long>(filesystem.f_bavail) *
                                filesystem.f_frsize) + " bytes";
  }
  throw TransportFailure("shared-memory segment " + name + " needs " + std::to_string(bytes) +
                         " bytes, but /dev/shm had " + free_space + " free: " +
                         std::strerror(err) +
                         " (give /dev/shm more space, e.g. docker run --shm-size)");
}

}  // namespace

SharedSegment SharedSegment::create(const std::string& name, size_t bytes) {
  check_name(name);
  if (bytes == 0) throw TransportFailure("shared-memory segment " + name + " of size 0");
  FileDescriptor fd(::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600));
  if (fd.get() < 0) throw_errno("shm_open(O_CREAT|O_EXCL) of " + name);
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    ::shm_unlink(name.c_str());
    errno = err;
    throw_errno("ftruncate of shared-memory segment " + name + " to " + std::to_string(bytes) +
                " bytes (is /dev/shm large enough?)");
  }
  reserve_pages(fd.get(), bytes, name);
  void* data = nullptr;
  try {
    data = map_shared(fd.get(), bytes, name);
  } catch (...) {
    ::shm_unlink(name.c_str());
    throw;
  }
  return SharedSegment(name, data, bytes, true);
}

SharedSegment SharedSegment::attach(const std::string& name) {
  check_name(name);
  FileDescriptor fd(::shm_open(name.c_str(), O_RDWR, 0));
  if (fd.get() < 0) throw_errno("shm_open of " + name);
  struct stat info {};
  if (::fstat(fd.get(), &info) != 0) throw_errno("fstat of shared-memory segment " + name);
  if (info.st_size <= 0) throw TransportFailure("shared-memory segment " + name + " is empty");
  const auto bytes = static_cast<size_t>(info.st_size);
  return SharedSegment(name, map_shared(fd.get(), bytes, name), bytes, true);
}

SharedSegment::SharedSegment(std::string name, void* data, size_t size, bool linked)
    : name_(std::move(name)), data_(data), size_(size), linked_(linked) {}

SharedSegment::SharedSegment(SharedSegment&& other) noexcept
    : name_(std::move(other.name_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      linked_(std::exchange(other.linked_, false)) {}

SharedSegment& SharedSegment::operator=(SharedSegment&& other) noexcept {
  if (this != &other) {
    release();
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    linked_ = std::exchange(other.linked_, false);
  }
  return *this;
}

SharedSegment::~SharedSegment() { release(); }

void SharedSegment::unlink() {
  if (!linked_) return;
  linked_ = false;
  // The other side may have removed it already: that is the expected race, not an error.
  if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT) {
    throw_errno("shm_unlink of " + name_);
  }
}

void SharedSegment::release() noexcept {
  if (linked_) {
    ::shm_unlink(name_.c_str());
    linked_ = false;
  }
  if (data_ != nullptr) {
    ::munmap(data_, size_);
    data_ = nullptr;
  }
}

}  // namespace dpp
