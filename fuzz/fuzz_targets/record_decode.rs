//! The pod record decoder: arbitrary bytes from `<state-dir>/pods/*.json` must decode or
//! be refused, never panic, and whatever decodes must survive an encode/decode round trip.
#![no_main]

use aether_worker::storage::{decode_record, encode_record, valid_uid};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(pod) = decode_record(data) {
        assert!(valid_uid(&pod.uid), "decoded an unsafe uid {:?}", pod.uid);
        let again = decode_record(&encode_record(&pod)).expect("an encoded record decodes");
        assert_eq!(again, pod);
    }
});
