"""What the services share to talk to Kafka: the exporters' batch producer, the output
producer and its acknowledged publishing, the Faust app and group runner, the topology feed,
the gap re-fetch and commit watch, librdkafka logging, and the one module that reaches into
Faust and aiokafka internals (:mod:`services.kafka.internals`)."""
