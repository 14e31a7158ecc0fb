// Drains one shared-memory receive channel into the rank's Mailbox from a thread of its
// own: every arrival is copied at once into a tensor the receiver owns (host memory, or
// the receiver's GPU for GPU tensors), so ring slots free quickly and no Python thread
// stands between the ring and the waiting schedule.
#pragma once

#include <cstdint>
#include <string>
#include <thread>

#include "mailbox.h"
#include "shm_channel.h"

namespace dpp {

class ShmDrain {
 public:
  // `label` names the channel in errors. GPU messages land on `device` (-1: host only),
  // copied on `copy_stream` and handed to work on `consumer_stream` (CUDA stream handles).
  ShmDrain(ShmReceiver& receiver, Mailbox& mailbox, std::string label, int device,
           uintptr_t copy_stream, uintptr_t consumer_stream);
  ShmDrain(const ShmDrain&) = delete;
  ShmDrain& operator=(const ShmDrain&) = delete;
  // Interrupts the receiver and joins the thread.
  ~ShmDrain();

  // Waits for the thread: it ends when the sender closes the channel, the receiver is
  // interrupted, or a failure was recorded in the mailbox.
  void join();

 private:
  void run();
  // Copies the current message into a tensor of its own and puts it into the mailbox (a
  // GPU message as soon as its copy is queued); false when interrupted meanwhile.
  bool deliver(const MessageMeta& meta);
  // An empty tensor on the device for a GPU message like `meta`, usable on the consumer
  // stream.
  at::Tensor device_tensor(const MessageMeta& meta) const;

  ShmReceiver& receiver_;
  Mailbox& mailbox_;
  std::string label_;
  int device_;
  uintptr_t copy_stream_;
  uintptr_t consumer_stream_;
  std::thread thread_;
};

// The tensor dtype of a wire dtype code (the Python DTYPE_CODES); throws for unknown codes.
at::ScalarType scalar_type_of(int32_t code);

}  // namespace dpp
